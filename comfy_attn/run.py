"""One graph run's attention: what the engine did from the run's first routed call on.

A run is one prompt that ComfyUI executes (its prompt id). A run holds a ``lib_attn.Recording`` made
when it began, which counts every engine call from then on, whichever node (sampler, VAE decode) or
the global route made it. The last run's report is the
status route's ``last_report``; it is sent to the UI as the server message ``flash-attention.report``
when a routed sampling or VAE pass ends, and by the Attention report node.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time

import lib_attn
from lib_attn.report import Report, VramProbe

from . import readout

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
        with lib_attn.use(**config) if config else contextlib.nullcontext():
            yield run
    finally:
        run.touched = time.perf_counter()
        send(run.report())


def last_report() -> Report | None:
    """The report of the last run (the one going on, while it goes on)."""
    run = _run
    return None if run is None else run.report()


def current_report() -> Report | None:
    """The report of the run ComfyUI is executing, None when no routed call was made in it."""
    run = _run
    return run.report() if run is not None and run.prompt_id == prompt_id() else None


def send(report: Report) -> None:
    """The report to every UI client, as the server message ``MESSAGE`` (its JSON, with ``text``)."""
    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    if server is not None:
        server.send_sync(MESSAGE, readout.to_json(report))


def reset() -> None:
    """Forget the run and where the execution context is read from (tests)."""
    global _run, _context
    with _lock:
        _run = None
        _context = None
