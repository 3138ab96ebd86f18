"""The always-visible script's body: accordion, per-generation override, counters, readout, infotext.

The entry script's ``Script`` delegates here. One generation runs from ``process`` to ``postprocess``
(both on the thread that generates, Forge's worker thread included); its counters are a
``lib_attn.recording()`` opened in ``process`` and closed in ``postprocess``, so they hold that
generation's calls whatever thread makes them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import lib_attn
from lib_attn.report import INFOTEXT_FALLBACKS_KEY, INFOTEXT_KEY, Report, VramProbe, host_vram, monitor_running

from . import layers, settings
from .flags import DENOISER_ROLES

TITLE = "Flash Attention"

_lock = threading.Lock()
_open: list = []
_last: Report | None = None


@dataclass
class _Generation:
    p: object
    job: object
    context: object
    rec: object
    probe: VramProbe | None
    previous_layer: dict | None

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        layers.set_layer("generation", self.previous_layer)


def title() -> str:
    return TITLE


def last_report() -> Report | None:
    """The report of the last finished generation, or None."""
    return _last


def override_value(args) -> str | None:
    """The override's backend id from the script's arguments; None for "use setting" or no value."""
    value = args[0] if args else None
    return value if value in lib_attn.BACKEND_IDS else None


def generation_layer(override: str | None) -> dict | None:
    """The ``generation`` layer that puts ``override`` first for the UNet/DiT; other roles unchanged."""
    if override is None:
        return None
    return {"preference": {role: [override] for role in DENOISER_ROLES}}


def override_from_params(params: dict) -> str | None:
    """Paste-back: the backend that ran the denoiser in a pasted infotext, None when it names none."""
    report = Report.from_infotext(params or {})
    if report is None:
        return None
    backend = report.main_backend()
    return backend if backend in lib_attn.BACKEND_IDS else None


def ui(script, is_img2img):
    from . import ui as ui_parts

    parts = ui_parts.accordion(is_img2img, last_report)
    script.infotext_fields = [(parts["override"], override_from_params)]
    script.paste_field_names = [INFOTEXT_KEY]
    return [parts["override"]]


def _shared():
    try:
        from modules import shared
    except ImportError:
        return None
    return shared


def _job(shared):
    state = getattr(shared, "state", None) if shared is not None else None
    return getattr(state, "job_timestamp", None)


def _infotext_entry(rec, key: str):
    """An ``extra_generation_params`` value: the webui calls it when it writes each image's infotext,
    by which time that image's sampling and decoding have run."""
    def value(**_):
        return Report.from_recording(rec).to_infotext().get(key)

    return value


def _close_stale(job) -> None:
    # A generation that raised never reaches postprocess; one of another job (or of an unknown
    # job) is over. Nested generations (an extension running one inside another) share the job.
    while _open and (job is None or _open[-1].job != job):
        _open.pop().close()


def process(p, *args):
    """Before sampling: apply settings and override, start this generation's counters."""
    shared = _shared()
    job = _job(shared)
    with _lock:
        _close_stale(job)
        settings.apply(getattr(shared, "opts", None))
        previous = layers.get_layer("generation")
        layers.set_layer("generation", generation_layer(override_value(args)))
        context = lib_attn.recording()
        rec = context.__enter__()
        probe = None
        if not monitor_running(getattr(shared, "mem_mon", None)):
            probe = VramProbe(getattr(shared, "device", None)).start()
        _open.append(_Generation(p, job, context, rec, probe, previous))
    params = getattr(p, "extra_generation_params", None)
    if params is not None:
        params[INFOTEXT_KEY] = _infotext_entry(rec, INFOTEXT_KEY)
        params[INFOTEXT_FALLBACKS_KEY] = _infotext_entry(rec, INFOTEXT_FALLBACKS_KEY)


def _take(p) -> _Generation | None:
    for index in range(len(_open) - 1, -1, -1):
        if _open[index].p is p:
            while len(_open) > index + 1:  # generations nested in this one that never finished
                _open.pop().close()
            return _open.pop()
    return None


def postprocess(p, processed, *args):
    """After the last batch: stop the counters, keep the report, show the readout under the image."""
    global _last
    shared = _shared()
    with _lock:
        gen = _take(p)
        if gen is None:
            return
        gen.close()
    vram = host_vram(getattr(shared, "mem_mon", None)) if gen.probe is None else gen.probe.stop()
    report = Report.from_recording(gen.rec, vram=vram)
    _last = report
    if settings.readout_enabled(getattr(shared, "opts", None)):
        show(p, processed, report)


def show(p, processed, report: Report) -> None:
    """Add the readout lines as comments: to ``p`` and to ``processed``, whose comments text was
    copied from ``p`` before postprocess ran (the webui renders ``processed.comments``)."""
    for line in report.lines():
        if hasattr(p, "comment"):
            p.comment(line)
        comments = getattr(processed, "comments", None)
        if isinstance(comments, str) and line not in comments:
            processed.comments = comments + (line if not comments or comments.endswith("\n") else "\n" + line) + "\n"


def on_ui_settings():
    settings.register()


def on_app_started(demo, app):
    from . import api

    api.register(app)
    settings.apply()


def reset() -> None:
    """Close every open generation and forget the last report (tests; script unload)."""
    global _last
    with _lock:
        while _open:
            _open.pop().close()
        _last = None
