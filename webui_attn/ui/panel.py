"""The always-visible script's body: accordion, per-generation override, counters, readout, infotext.

The entry script's ``Script`` delegates here. One generation runs from ``process`` to ``postprocess``
(both on the thread that generates, Forge's worker thread included); its counters are a
``lib_attn.recording()`` opened in ``process`` and closed in ``postprocess``, so they hold the calls
that thread makes for the generation (a live preview that another thread decodes is not among them).
Each batch (``before_process_batch`` to the next one's) is marked in them, so that each image's
infotext counts the calls of its own batch.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import lib_attn
from lib_attn.config import GUARD_MODES
from lib_attn.report import Report, VramProbe

from host_attn import voice
from host_attn.patching import Patches

from ..routing import detect, sampling
from ..settings import layers, stored
from ..settings.choices import USE_SETTING, backend_from_choice
from ..settings.flags import DENOISER_ROLES, host_choice_note, schedule_problem, sparse_problem
from . import readout, settings_page
from .readout import (INFOTEXT_FALLBACKS_KEY, INFOTEXT_GUARD_KEY, INFOTEXT_GUARD_OVERRIDE_KEY, INFOTEXT_KEY,
                      INFOTEXT_KEYS, INFOTEXT_NOTE_KEY, INFOTEXT_OVERRIDE_KEY, INFOTEXT_SCHEDULE_KEY,
                      INFOTEXT_SPARSE_KEY)

TITLE = "Flash Attention"

_lock = threading.Lock()
_open: list = []
#: (p, the extension's settings before the webui applied p's ``override_settings``), from ``before_process``.
_before_override: list = []


@dataclass
class _Generation:
    p: object
    job: object
    context: object
    rec: object
    probe: VramProbe | None
    previous_layer: dict | None
    notes: tuple
    routing: voice.Routing
    follower: sampling.Follower | None = None
    #: batch number -> [mark at its start ({}: the generation's), mark at the next batch's start or None]
    batches: dict = dataclasses.field(default_factory=dict)
    #: the settings the request's ``override_settings`` replaced, put back when it ends (or None)
    restore: dict | None = None
    #: the token of the extension's forwards put over the webui's own attention for this generation, or None
    lent: object = None
    #: the backend chosen for this generation (its ``Attention override``), or None
    override: str | None = None
    #: denoiser calls (``cfg_denoiser`` callbacks) made in this generation
    steps: int = 0
    #: the loaded denoiser's class, as ``module.Class``, when the model shows it
    denoiser: str | None = None

    def part(self, p=None, use_main_prompt: bool = False):
        """The calls of the batch ``p`` is in (``p.iteration``), or of the whole job for the grid
        (``use_main_prompt``) or where the batch was not marked."""
        marks = None if use_main_prompt else self.batches.get(getattr(p, "iteration", None))
        return self.rec if marks is None else self.rec.since(*marks)

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
        self.context.__exit__(None, None, None)
        if self.probe is not None:
            self.probe.stop()   # its polling thread ends with the generation (a no-op once read)
        if self.lent is not None:
            detect.adapter().end_generation(self.lent)
        layers.set_layer("generation", self.previous_layer)
        if self.restore is not None:
            # the webui puts the options back with setattr, which runs no onchange: follow it here
            stored.apply_settings(values={**stored.read(), **self.restore})


def title() -> str:
    return TITLE


def read_override(args) -> tuple[str | None, str | None]:
    """(backend id or None, problem or None) from the script's arguments.

    "use setting" or no argument: no override. A backend id, or a dropdown label of one: that id.
    Anything else is a problem, named with the valid values; the generation then runs as if no override
    was given (a script cannot refuse a request: the webuis catch and log its errors and go on).
    """
    value = args[0] if args else None
    if value is None or value == USE_SETTING:
        return None, None
    backend = backend_from_choice(value)
    if backend is not None:
        return backend, None
    return None, (f"override {value!r} ignored (not a backend id), the setting used; valid: {USE_SETTING}, "
                  f"{', '.join(lib_attn.BACKEND_IDS)} (over the API: \"args\": [\"<id>\"], a list)")


def read_guard(args) -> tuple[str | None, str | None]:
    """(guard mode or None, problem or None) from the script's second argument: "use setting" or none
    leaves the setting in force; a mode sets it for this generation; anything else is a problem named
    with the valid values, and the setting is used."""
    value = args[1] if len(args) > 1 else None
    if value is None or value == USE_SETTING:
        return None, None
    if value in GUARD_MODES:
        return value, None
    return None, (f"guard {value!r} ignored, the setting used; valid: {USE_SETTING}, {', '.join(GUARD_MODES)} "
                  f"(over the API: \"args\": [\"<id or {USE_SETTING}>\", \"<guard>\"])")


SCHEDULE_API = "(over the API: \"args\": [\"<backend or use setting>\", \"<guard or use setting>\", \"<schedule>\"])"


def read_schedule(args) -> tuple[str | None, str | None]:
    """(schedule text or None, problem or None) from the script's third argument: empty or none leaves
    the setting's in force; ``off`` runs this generation without one; any other text must be a whole
    valid schedule. A problem names the rule, the part that is wrong and what is valid, and refuses the
    generation (``process``)."""
    value = args[2] if len(args) > 2 else None
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    problem = schedule_problem(value)
    if problem:
        return None, f"schedule for this generation: {problem} {SCHEDULE_API}"
    return value.strip(), None


SPARSE_API = ("(over the API: \"args\": [\"<backend or use setting>\", \"<guard or use setting>\", \"<schedule>\", "
              "\"<sparse>\"])")


def read_sparse(args) -> tuple[str | None, str | None]:
    """(sparse settings text or None, problem or None) from the script's fourth argument: empty or none
    leaves the setting's in force; ``off`` runs this generation without; any other text must be whole
    valid settings. A problem names the value and the valid ones, and refuses the generation."""
    value = args[3] if len(args) > 3 else None
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    problem = sparse_problem(value)
    if problem:
        return None, f"sparse attention for this generation: {problem} {SPARSE_API}"
    return value.strip(), None


def generation_layer(override: str | None, guard: str | None = None, schedule: str | None = None,
                     sparse: str | None = None) -> dict | None:
    """The ``generation`` layer that puts ``override`` first for the UNet/DiT (other roles unchanged) and
    sets the ``guard`` mode, the ``schedule`` and the ``sparse`` settings for this generation."""
    layer = {}
    if override is not None:
        layer["preference"] = {role: [override] for role in DENOISER_ROLES}
    if guard is not None:
        layer["guard"] = guard
    if schedule is not None:
        layer["schedule"] = schedule
    if sparse is not None:
        layer["sparse"] = sparse
    return layer or None


def override_from_params(params: dict) -> str:
    """Paste-back of the backend field: the backend chosen for that generation (``Attention override``),
    else "use setting". What ran (``Attention``) is never put there: it may be a fallback, and pinning it
    would set aside the settings, the optimizer entry and the flags from then on."""
    return backend_from_choice((params or {}).get(INFOTEXT_OVERRIDE_KEY)) or USE_SETTING


def guard_from_params(params: dict) -> str:
    """Paste-back of the guard field: the guard chosen for that generation, else "use setting"."""
    value = str((params or {}).get(INFOTEXT_GUARD_OVERRIDE_KEY) or "").strip()
    return value if value in GUARD_MODES else USE_SETTING


def schedule_from_params(params: dict) -> str | None:
    """Paste-back of the schedule field: the schedule that generation ran under, empty (the setting's)
    when it ran under none, and None (the field is left as it is) when its text cannot be read here."""
    if not str((params or {}).get(INFOTEXT_SCHEDULE_KEY) or "").strip():
        return ""
    return readout.schedule_from_infotext(params)


def sparse_from_params(params: dict) -> str | None:
    """Paste-back of the sparse field: the sparse settings that generation ran under, empty (the setting's)
    when it ran under none, so that a pasted image made without reproduces without; None (the field is
    left as it is) when the text cannot be read here."""
    if not str((params or {}).get(INFOTEXT_SPARSE_KEY) or "").strip():
        return ""
    return readout.sparse_from_infotext(params)


#: The paste-back readers, one per field in the order of ``ui``'s components. The webui's "Send to
#: txt2img/img2img" copies a field whose reader is in ``paste_field_names``: each reader is one function
#: object, the same in both tabs, so the fields of the two tabs match up.
PASTE_READERS = (override_from_params, guard_from_params, schedule_from_params, sparse_from_params)


#: The webui's element updated at the end of every generation (the comments and time under the image),
#: created after the scripts' UI in both hosts' output panel; the readout follows it.
OUTPUT_ELEM = "html_log_{tab}"


def ui(script, is_img2img):
    from . import components

    hook = getattr(script, "on_after_component", None)
    parts = components.accordion(is_img2img, refresh=hook is None)
    if hook is not None:
        tab = "img2img" if is_img2img else "txt2img"
        hook(lambda on: components.follow(on.component, parts["readout"]),
             elem_id=OUTPUT_ELEM.format(tab=tab))
    fields = [parts["override"], parts["guard"], parts["schedule"], parts["sparse"]]
    script.infotext_fields = list(zip(fields, PASTE_READERS))
    script.paste_field_names = list(PASTE_READERS)
    return fields


def _shared():
    try:
        from modules import shared
    except ImportError:
        return None
    return shared


def _job(shared):
    """The job a generation belongs to: A1111 stamps each job's start to the second (``job_timestamp``),
    so two API requests within a second share it; the start time (``time_start``) tells them apart."""
    state = getattr(shared, "state", None) if shared is not None else None
    stamp = getattr(state, "job_timestamp", None)
    return None if stamp is None else (stamp, getattr(state, "time_start", None))


def _infotext_entry(gen: _Generation, key: str):
    """An ``extra_generation_params`` value: the webui calls it when it writes each image's infotext
    (with that ``p`` and the webui's ``use_main_prompt`` for the grid), by which time that image's batch
    has been sampled and decoded: it counts that batch's calls (the grid's, the whole job's)."""
    def value(p=None, use_main_prompt=False, **_):
        return readout.to_infotext(Report.from_recording(gen.part(p, use_main_prompt))).get(key)

    return value


def _note_entry(gen: _Generation):
    """The ``Attention note`` entry: the generation's notes, and for each image whether its batch's
    denoiser calls missed this extension (``unrouted_note``)."""
    def value(p=None, use_main_prompt=False, **_):
        missed = unrouted_note(gen, gen.part(p, use_main_prompt))
        notes = (*gen.notes, *([missed] if missed else ()))
        return readout.to_infotext(Report(notes=notes)).get(INFOTEXT_NOTE_KEY) if notes else None

    return value


def _override_entry(gen: _Generation):
    """The ``Attention override`` entry: the backend chosen, unless the batch's denoiser calls did not
    go through this extension (then it was not applied, and the note says so)."""
    def value(p=None, use_main_prompt=False, **_):
        return None if unrouted_note(gen, gen.part(p, use_main_prompt)) else gen.override

    return value


def _close_stale(job) -> None:
    # A generation that raised never reaches postprocess; one of another job (or of an unknown
    # job) is over. Nested generations (an extension running one inside another) share the job.
    while _open and (job is None or _open[-1].job != job):
        _open.pop().close()


def asks_for_engine(override: str | None, values: dict) -> bool:
    """Whether this generation asks for this extension's backends: one chosen for it, a schedule or sparse
    settings in force (for it, from the settings or the flags), or a backend or VAE backend set in the
    settings. Called once this generation's layer is in force."""
    config = lib_attn.config()
    return bool(override is not None or config.schedule is not None or config.sparse is not None
                or backend_from_choice(values.get(stored.KEY_BACKEND))
                or backend_from_choice(values.get(stored.KEY_VAE_BACKEND)))


def denoiser_of(p) -> str | None:
    """The class of the model's denoiser, ``module.Class``: Forge's lines hold it at
    ``sd_model.forge_objects.unet.model.diffusion_model``, A1111 at ``sd_model.model.diffusion_model``."""
    for path in (("forge_objects", "unet", "model", "diffusion_model"), ("model", "diffusion_model")):
        found = getattr(p, "sd_model", None)
        for attr in path:
            found = getattr(found, attr, None)
        if found is not None:
            cls = type(found)
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def unrouted_note(gen: _Generation, part) -> str | None:
    """What to say when the denoiser ran (a ``cfg_denoiser`` step) but none of its attention calls in
    ``part`` (a recording) went through this extension while its patches are in place: a model family
    the routing does not reach, or one whose function another extension holds. Its calls ran on the
    host's attention, and an override was not applied to them."""
    if not gen.routing.routed or gen.steps == 0 or any(role in DENOISER_ROLES for role, _ in part.calls):
        return None
    what = f"the denoiser's attention ({gen.denoiser})" if gen.denoiser else "the denoiser's attention"
    host = detect.detect().name
    note = f"{what} did not go through this extension: it ran on {host}'s own attention or another extension's"
    if gen.override is not None:
        note += f"; override {gen.override!r} not applied to it"
    return note


def _notes(override: str | None, problem: str | None, route: voice.Routing, opts) -> tuple:
    """What this generation's readout and infotext should say beside the calls."""
    notes = []
    if problem:
        voice.log(problem)
        notes.append(problem)
    notes.extend(stored.problems(stored.read(opts)))
    if override and not route.routed:
        notes.append(f"override {override!r} not applied: attention runs on {route.ran_on}")
    return tuple(notes)


def _own_records(p) -> None:
    """A generation run on a copy of an open generation's ``p`` (an extension's pass on each image made
    with ``copy(p)``; A1111's ``p`` is a dataclass, and its copy shares the dicts) gets dicts of its own for
    its infotext entries and readout lines, so that the open generation's images keep their counts."""
    for attr in ("extra_generation_params", "comments"):
        value = getattr(p, attr, None)
        if isinstance(value, dict) and any(getattr(gen.p, attr, None) is value for gen in _open if gen.p is not p):
            setattr(p, attr, dict(value))


def before_process(p, *args):
    """Before the webui applies ``p.override_settings``: keep the settings they may replace."""
    with _lock:
        _before_override[:] = [(p, stored.read(getattr(_shared(), "opts", None)))]


def _restore_after(p) -> dict | None:
    """The extension's settings a request's ``override_settings`` replace for this generation, at the
    values the webui puts back when it ends; None when it replaces none or keeps them
    (``override_settings_restore_afterwards`` off)."""
    keys = [key for key in (getattr(p, "override_settings", None) or {}) if key in stored.DEFAULTS]
    before = next((values for owner, values in _before_override if owner is p), None)
    _before_override.clear()
    if not keys or before is None or not getattr(p, "override_settings_restore_afterwards", True):
        return None
    return {key: before[key] for key in keys}


def process(p, *args):
    """Before sampling: apply settings and override, start this generation's counters. A bad schedule
    (the third argument, or the setting when that is left empty) refuses the generation: nothing of it
    is applied, the webui is asked to stop before the first batch, and the message is shown."""
    shared = _shared()
    job = _job(shared)
    override, problem = read_override(args)
    guard, guard_problem = read_guard(args)
    schedule, refusal = read_schedule(args)
    sparse, sparse_refusal = read_sparse(args)
    refusal = refusal or sparse_refusal
    opts = getattr(shared, "opts", None)
    if refusal is None and schedule is None:
        refusal = stored.setting_schedule_problem(stored.read(opts))
    if refusal is None and sparse is None:
        refusal = stored.setting_sparse_problem(stored.read(opts))
    with _lock:
        _close_stale(job)
        _own_records(p)
        restore = _restore_after(p)
        stored.apply_settings(opts)
        previous = layers.get_layer("generation")
        if refusal is None:
            try:
                layers.set_layer("generation", generation_layer(override, guard, schedule, sparse))
            except ValueError as exc:  # set_layer has put the previous layer back
                refusal = str(exc)
        lent = (detect.lend_for_generation(opts)
                if refusal is None and asks_for_engine(override, stored.read(opts)) else None)
        route = detect.routing()
        notes = _notes(override, problem, route, opts)
        if guard_problem:
            voice.log(guard_problem)
            notes = (*notes, guard_problem)
        if lent is not None:
            notes = (*notes, detect.adapter().lent_note())
        chosen = host_choice_note(detect.detect().name) if route.routed and refusal is None else None
        if chosen:
            notes = (*notes, chosen)
        cfg = lib_attn.config() if refusal is None else None
        sparse_in_force = cfg.sparse if cfg is not None else None
        follower = None
        if cfg is not None and not route.routed:
            notes = (*notes, *(f"{what} {value.text!r} not applied: attention runs on {route.ran_on}"
                               for what, value in (("schedule", cfg.schedule), ("sparse attention", cfg.sparse))
                               if value is not None))
        elif cfg is not None and (cfg.positional is not None or cfg.sparse is not None):
            # the schedule's rules, then sparse attention's dense windows: both need where sampling is; sparse
            # attention's routing, the joint blocks' text tokens
            follower = sampling.Follower(cfg.positional, shared, text=cfg.sparse is not None)
        context = lib_attn.recording()
        rec = context.__enter__()
        probe = None if readout.host_measures(p, shared) else readout.own_probe(shared).start()
        if refusal is not None:
            notes = (*(n for n in notes if n != refusal), f"generation refused: {refusal}")
        gen = _Generation(p, job, context, rec, probe, previous, notes, route, follower, restore=restore, lent=lent,
                          override=override, denoiser=denoiser_of(p))
        _open.append(gen)
    if refusal is not None:
        refuse(p, shared, notes[-1])
    params = getattr(p, "extra_generation_params", None)
    if params is not None:
        for key in (INFOTEXT_KEY, INFOTEXT_FALLBACKS_KEY, INFOTEXT_GUARD_KEY):
            params[key] = _infotext_entry(gen, key)
        if follower is not None and cfg.schedule is not None:
            # configuration, known now: params.txt (written before sampling) carries it too
            params[INFOTEXT_SCHEDULE_KEY] = cfg.schedule.text
        params[INFOTEXT_NOTE_KEY] = _note_entry(gen)
        if sparse_in_force is not None and route.routed:
            # only where it applies: pasted back, the key turns sparse attention on
            params[INFOTEXT_SPARSE_KEY] = sparse_in_force.text
        if refusal is None:
            # what the user chose, apart from what ran: paste-back restores these
            if override is not None:
                params[INFOTEXT_OVERRIDE_KEY] = _override_entry(gen)
            if guard is not None:
                params[INFOTEXT_GUARD_OVERRIDE_KEY] = guard


def refuse(p, shared, message: str) -> None:
    """Stop the generation before its first batch, the webuis' own way: a script's exception is caught
    and logged by their script runner, but ``state.interrupt()`` makes ``process_images_inner`` leave
    its batch loop before sampling (every line checks ``state.interrupted`` there; each job starts with
    it cleared). The message goes to the log and under the (absent) image, as the readout's note line."""
    voice.log(message)
    if hasattr(p, "comment"):
        p.comment(f"{INFOTEXT_NOTE_KEY}: {message}")
    webui_state = getattr(shared, "state", None)
    if callable(getattr(webui_state, "interrupt", None)):
        webui_state.interrupt()
    elif webui_state is not None:
        webui_state.interrupted = True


def on_cfg_denoiser(params) -> None:
    """``cfg_denoiser`` callback (each denoiser call): where sampling is, for the schedule in force."""
    if _open:
        _open[-1].steps += 1
    follower = _open[-1].follower if _open else None
    if follower is not None:
        follower.step(params)


def _generation_of(p) -> _Generation | None:
    return next((gen for gen in reversed(_open) if gen.p is p), None)


def before_process_batch(p, batch_number=None) -> None:
    """A batch starts: mark the counters, so that its images' infotexts count its calls alone.

    A batch's calls run from its start to the next batch's: after its sampling and decoding come the
    passes run on its images before their infotexts are written (an extension's ``postprocess_image``,
    such as ADetailer's), and an image's infotext counts those run so far. The first batch's start is the
    generation's, so that the passes before it (img2img's encoding of its init image) count in it."""
    gen = _generation_of(p)
    if gen is None or batch_number is None:
        return
    mark = gen.rec.mark()
    for marks in gen.batches.values():
        if marks[1] is None:
            marks[1] = mark
    gen.batches[batch_number] = [mark if gen.batches else {}, None]


def generation_left(p) -> None:
    """``process_images_inner`` returned or raised for ``p``: a generation of ``p`` still open never reached
    ``postprocess`` (it raised, an X/Y/Z cell the grid script caught included), and ends here, with what it
    put in force (settings layer, lent forwards, VRAM polling) and the generations nested in it."""
    with _lock:
        gen = _take(p)
        if gen is not None:
            gen.close()


def _watched_inner(process_images_inner):
    def watched_process_images_inner(p, *args, **kwargs):
        try:
            return process_images_inner(p, *args, **kwargs)
        finally:
            generation_left(p)

    watched_process_images_inner.__wrapped__ = process_images_inner
    return watched_process_images_inner


_watch = Patches("webui-generations")


def watch_generations() -> None:
    """Follow each generation's end in the webui's ``processing.process_images_inner`` (``process_images``
    calls it by its module name in A1111 and the Forge lines), so that one that raised ends at once."""
    global _watch
    try:
        import modules.processing as processing
    except ImportError:
        return
    if not hasattr(processing, "process_images_inner") or (_watch.active and _watch.intact()):
        return
    _watch = Patches("webui-generations")   # wrapped over since by another: ours stays inside theirs
    _watch.patch(processing, "process_images_inner", _watched_inner(processing.process_images_inner))


def unwatch_generations() -> None:
    if _watch.intact():
        _watch.undo()


def _take(p) -> _Generation | None:
    for index in range(len(_open) - 1, -1, -1):
        if _open[index].p is p:
            while len(_open) > index + 1:  # generations nested in this one that never finished
                _open.pop().close()
            return _open.pop()
    return None


def postprocess(p, processed, *args):
    """After the last batch: stop the counters, keep the report, show the readout under the image."""
    shared = _shared()
    with _lock:
        gen = _take(p)
        if gen is None:
            return
        vram = readout.host_vram(getattr(shared, "mem_mon", None)) if gen.probe is None else gen.probe.stop()
        gen.close()
    missed = unrouted_note(gen, gen.rec)
    report = dataclasses.replace(Report.from_recording(gen.rec, vram=vram),
                                 notes=(*gen.notes, *([missed] if missed else ())),
                                 ran_on=gen.routing.ran_on, hint=gen.routing.hint)
    readout.set_last_report(report)
    settle_infotext(p, report)
    params = getattr(p, "extra_generation_params", None)
    if params is not None and INFOTEXT_OVERRIDE_KEY in params:
        if missed:
            del params[INFOTEXT_OVERRIDE_KEY]
        else:
            params[INFOTEXT_OVERRIDE_KEY] = gen.override
    if stored.readout_enabled(getattr(shared, "opts", None)):
        show(p, processed, report)


def settle_infotext(p, report: Report) -> None:
    """Replace the lazy infotext entries with their final text: the webuis' API serialises ``info`` with
    ``extra_generation_params`` after postprocess, and writes a callable there as null."""
    params = getattr(p, "extra_generation_params", None)
    if params is None:
        return
    final = readout.to_infotext(report)
    for key in INFOTEXT_KEYS:
        if key in params:
            if final.get(key) is None:
                del params[key]
            else:
                params[key] = final[key]


def show(p, processed, report: Report) -> None:
    """Add the readout lines as comments: to ``p`` and to ``processed``, whose comments text was
    copied from ``p`` before postprocess ran (the webui renders ``processed.comments``)."""
    for line in readout.lines(report):
        if hasattr(p, "comment"):
            p.comment(line)
        comments = getattr(processed, "comments", None)
        if isinstance(comments, str) and line not in comments:
            processed.comments = comments + (line if not comments or comments.endswith("\n") else "\n" + line) + "\n"


def on_ui_settings():
    settings_page.register()


def on_app_started(demo, app):
    from . import api

    api.register(app)
    stored.apply_settings()


def reset() -> None:
    """Close every open generation and forget the last report (tests; script unload)."""
    with _lock:
        while _open:
            _open.pop().close()
    readout.set_last_report(None)
