"""One graph run's attention: what the engine did from the run's first routed call on.

A run is one prompt that ComfyUI executes (its prompt id). A run holds a ``lib_attn.Recording`` made
when it began, which counts every engine call from then on, whichever node (sampler, VAE decode) or
the global route made it. The last run's report is the
status route's ``last_report``; it is sent to the UI as the server message ``flash-attention.report``
when a routed sampling or VAE pass ends, and by the Attention report node: with its prompt id, to the
client that queued the prompt, as ComfyUI sends a node's output (none when no client queued it: an API
script), so that a page shows its own prompts' reports only.

ComfyUI serves a node whose inputs did not change from its cache, without running it: a report node
that runs on images made by an earlier prompt (its upstream came from the cache) shows what ran when
they were made. So each run remembers, weakly, the images its routed VAE passes returned and the
images its report node was given. Under the global route a prompt that sent no report (its VAE pass
came from the cache, and it has no report node, or that came from the cache too) sends the report of
the run that made the images its cache entries hold, with the same note, when it ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
import weakref

import lib_attn
from lib_attn import readout
from lib_attn.report import Report, VramProbe

from host_attn import voice

MESSAGE = "flash-attention.report"

_lock = threading.Lock()


class Run:
    def __init__(self, prompt_id):
        self.prompt_id = prompt_id
        self.recording = lib_attn.Recording()  # counts every engine call from now on
        self.started = self.touched = time.perf_counter()
        self.probe = VramProbe().start()
        self.notes: list = []

    def report(self) -> Report:
        report = Report.from_recording(self.recording, seconds=self.touched - self.started, vram=self.probe.stop())
        return dataclasses.replace(report, notes=tuple(self.notes)) if self.notes else report


_run: Run | None = None
_context = None
#: (weak reference to images a run made or reported on, that run), newest last; a few runs' worth.
_made: list = []
KEEP = 16
#: The prompt whose report was sent last (by a sampling, a VAE pass or a report node).
_sent: list = [None]


def prompt_id():
    """The prompt ComfyUI is executing: its execution context's, else the server's last one."""
    global _context
    if _context is None:
        try:
            from comfy_execution.utils import get_executing_context as _context
        except ImportError:
            _context = lambda: None  # noqa: E731 - an older ComfyUI
    context = _context()
    if context is not None:
        return context.prompt_id
    server = getattr(sys.modules.get("server"), "PromptServer", None)
    return getattr(getattr(server, "instance", None), "last_prompt_id", None)


def begin() -> Run:
    """The current run (a new one when ComfyUI moved on to another prompt), touched now."""
    global _run
    pid = prompt_id()
    current = _run
    if current is None or current.prompt_id != pid:
        with _lock:
            if _run is None or _run.prompt_id != pid:
                if _run is not None:
                    _run.recording.finish()  # its counts stay those of its own prompt
                _run = Run(pid)
            current = _run
    current.touched = time.perf_counter()
    return current


def note(text: str) -> None:
    """Something the user should know about this run (shown with its report)."""
    run = begin()
    if text not in run.notes:
        run.notes.append(text)


@contextlib.contextmanager
def segment(config: dict | None = None):
    """A stretch of a run (sampling, a VAE decode) under ``config`` (``lib_attn.configure``'s
    arguments; None keeps the configuration in force). The report is sent to the UI when it ends,
    also when it ends with an error (strict mode)."""
    run = begin()
    try:
        with lib_attn.use(**config, hosted=True) if config else contextlib.nullcontext():
            yield run
    finally:
        run.touched = time.perf_counter()
        send(run.report(), run.prompt_id)


def last_report() -> Report | None:
    """The report of the last run (the one going on, while it goes on)."""
    run = _run
    return None if run is None else run.report()


def current_report() -> Report | None:
    """The report of the run ComfyUI is executing, None when no routed call was made in it."""
    run = _current()
    return None if run is None else run.report()


def _current() -> Run | None:
    run = _run
    return run if run is not None and run.prompt_id == prompt_id() else None


def remember(images, run: Run) -> None:
    """``images`` were made (or reported on) by ``run``."""
    try:
        ref = weakref.ref(images)
    except TypeError:  # not a tensor: nothing a later prompt could be handed again
        return
    with _lock:
        _made[:] = [(r, m) for r, m in _made if r() is not None and r() is not images][-(KEEP - 1):]
        _made.append((ref, run))


def made_by(images) -> Run | None:
    """The run that made or reported on ``images``, while they live."""
    for ref, run in reversed(list(_made)):
        if ref() is images:
            return run
    return None


def report_for(images) -> Report | None:
    """The report an Attention report node shows for ``images``: this prompt's run when it made a routed
    call, else the run that made the images (ComfyUI served them from its cache), else None."""
    run = _current()
    if run is not None:
        remember(images, run)
        return run.report()
    earlier = made_by(images)
    return None if earlier is None else cached_report(earlier)


def cached_report(earlier: Run) -> Report:
    """The report of ``earlier``, the run that made images ComfyUI served from its cache, with a note saying so."""
    report = earlier.report()
    cached = (f"these images come from ComfyUI's cache: this is what ran when they were made "
              f"(prompt {earlier.prompt_id})")
    return dataclasses.replace(report, notes=(*report.notes, cached))


def prompt_ended(prompt_id, values) -> Report | None:
    """Prompt ``prompt_id`` has ended (under the global route). Where it sent no report (no sampling or VAE pass
    of it ran, and no report node of it ran) and ``values``, the outputs ComfyUI's cache holds for its nodes,
    hold images an earlier run made, that run's report goes to the client that queued the prompt, with the
    cache note, as a report node would show it; returns it (None: nothing sent)."""
    if _sent[0] == prompt_id:
        return None
    order = {id(run): i for i, (_, run) in enumerate(list(_made))}
    runs = [run for run in map(made_by, values) if run is not None]
    if not runs:
        return None
    report = cached_report(max(runs, key=lambda run: order.get(id(run), -1)))
    send(report, prompt_id)
    return report


def send(report: Report, prompt_id=None) -> None:
    """The report of prompt ``prompt_id`` to the client that queued it (ComfyUI's ``client_id`` of the
    prompt it executes), as the server message ``MESSAGE``: its JSON, with ``text`` and ``prompt_id``."""
    _sent[0] = prompt_id
    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    client = getattr(server, "client_id", None)
    if server is not None and client is not None:
        try:
            server.send_sync(MESSAGE, {**readout.to_json(report), "prompt_id": prompt_id}, client)
        except Exception as exc:  # noqa: BLE001 - a report that cannot go out must not end ComfyUI's prompt worker
            voice.log_once(("comfy-report-send", type(exc).__name__), f"report not sent to the page: {exc!r}")


def reset() -> None:
    """Forget the run and where the execution context is read from (tests)."""
    global _run, _context
    with _lock:
        _run = None
        _context = None
        _made.clear()
        _sent[0] = None
