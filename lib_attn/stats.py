"""Counters of what ran: calls per (role, backend) and fallbacks per (role, backend, reason).

One recording is current at a time, process-wide, so counts are right whichever thread runs the
generation (Forge runs it on a worker thread).
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter

#: What each backend id ran as, e.g. {"flash-attn": {"flash-attn 2.8.3 (FA3)"}}, filled per decision.
_kernels: dict[str, set] = {}
#: (role, backend id) pairs that tuning chose for at least one call signature.
_tuned: set = set()


class Recording:
    """Counts for one stretch of work (a generation). ``calls``: Counter {(role, backend): n};
    ``fallbacks``: Counter {(role, backend passed over, reason): n}; ``seconds``: wall time."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.started = time.perf_counter()
        self.finished: float | None = None

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    @property
    def kernels(self) -> dict[str, str]:
        """What each backend that ran was, with its version and variant."""
        used = {backend for _, backend in self.calls}
        return {b: " / ".join(sorted(_kernels.get(b, {b}))) for b in sorted(used)}

    @property
    def tuned(self) -> set:
        """(role, backend id) pairs that ran where tuning chose them (for at least one call kind)."""
        return {pair for pair in self.calls if pair in _tuned}

    def total(self, role: str | None = None) -> int:
        return sum(n for (r, _), n in self.calls.items() if role is None or r == role)

    def __repr__(self):
        return f"Recording(calls={dict(self.calls)}, fallbacks={dict(self.fallbacks)})"


lifetime = Recording()
current = lifetime
# The current recording's counters, also as module globals: the hot path saves a lookup per call.
calls = current.calls
fallbacks = current.fallbacks
_last: Recording | None = None


def _make_current(rec: Recording) -> None:
    global current, calls, fallbacks
    current, calls, fallbacks = rec, rec.calls, rec.fallbacks


def note_kernel(backend: str, description: str) -> None:
    _kernels.setdefault(backend, set()).add(description)


def note_tuned(role: str, backend: str) -> None:
    _tuned.add((role, backend))


def forget_tuned() -> None:
    _tuned.clear()


@contextlib.contextmanager
def recording():
    """Count into a fresh Recording for the ``with`` block; yields it."""
    global _last
    saved, rec = current, Recording()
    _make_current(rec)
    try:
        yield rec
    finally:
        rec.finished = time.perf_counter()
        _make_current(saved)
        _last = rec
        if saved is not lifetime:  # a recording inside another one counts for both
            saved.calls.update(rec.calls)
            saved.fallbacks.update(rec.fallbacks)
        lifetime.calls.update(rec.calls)
        lifetime.fallbacks.update(rec.fallbacks)


def last_recording() -> Recording | None:
    return _last
