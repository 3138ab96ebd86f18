"""Counters of what ran: calls per (role, backend) and per schedule rule, fallbacks per (role, backend, reason) and what the
output guard caught per (role, backend, what, ran on, recomputed).

Each key has one process-wide ``Cell``; a cached decision holds its cells, so the hot path counts a
call with one attribute increment. A ``Recording`` counts in one of two ways:

* made by ``recording()`` (a ``with`` block), it counts the calls of its own thread or asyncio task
  only: the dispatcher adds each call to the recordings open in the scope in force
  (``lib_attn.scope``), so two threads that each record count their own calls, and a recording
  inside another one counts for both;
* made directly (``Recording()``), it is the difference of the process-wide cells between its start
  and its end (or now, while it is open): every thread's calls, for a host whose work one recording
  follows across its threads.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

from . import scope as _scope
from .sparse_report import SparseReport

#: What each backend id ran as, e.g. {"flash-attn": {"flash-attn 2.8.3 (FA3)"}}, filled per decision.
_kernels: dict[str, set] = {}
#: (role, backend id) pairs that tuning chose for at least one call signature.
_tuned: set = set()


class Cell:
    """The number of times one key was counted, in this process."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


#: (role, backend, rule) -> Cell; ``rule`` is (schedule text, rule label) for a call a schedule in force
#: served (``lib_attn.schedule.OTHERWISE`` as label when no rule took it), None without a schedule.
_calls: dict = {}
_fallbacks: dict = {}  # (role, backend passed over, reason) -> Cell
#: What each fallback went through: (fallback key, ((id, reason), ...) also passed over, id that ran) -> Cell.
_paths: dict = {}
_guard: dict = {}      # (role, backend caught, what, backend that ran instead, recomputed) -> Cell
#: Calls split over several ranks (``lib_attn.parallel``), and the bytes this rank sent for them, per
#: (role, kind, mode, ranks, ulysses degree, ring degree, note: why the call ran otherwise, or "").
_parallel: dict = {}
_parallel_bytes: dict = {}
#: Sparse attention (``lib_attn.sparse``): sparse calls per (role, backend, kind, setting); dense calls
#: per (role, reason) while it is on; measurements per (role, backend, kind, setting, error); the sum of
#: the share of blocks kept over those measurements per (role, backend, kind, setting); attention
#: seconds per ("sparse" or "dense",).
_sparse: dict = {}
_sparse_dense: dict = {}
_sparse_error: dict = {}
_sparse_replaced: dict = {}  # measured outputs over the budget, recomputed: (role, backend, kind, setting, error)
_sparse_kept: dict = {}
_sparse_seconds: dict = {}
_sparse_settings: dict = {}  # (settings text, budget) -> calls served while they were in force
#: (role, backend) -> calls made while autograd's engine ran a backward: recomputed by activation
#: checkpointing (also counted in ``_calls``; the forward calls are the difference).
_recomputed: dict = {}
_lock = threading.Lock()


def _cell(table: dict, key) -> Cell:
    found = table.get(key)
    if found is None:
        with _lock:
            found = table.setdefault(key, Cell())
    return found


def call_cell(key) -> Cell:
    """The cell counting calls of ``key`` = (role, backend id, rule or None)."""
    return _cell(_calls, key)


def fallback_cell(key) -> Cell:
    """The cell counting fallbacks of ``key`` = (role, backend passed over, reason)."""
    return _cell(_fallbacks, key)


def recomputed_cell(key) -> Cell:
    """The cell counting recomputed calls of ``key`` = (role, backend id)."""
    return _cell(_recomputed, key)


def path_cell(key) -> Cell:
    """The cell counting fallbacks that went ``key`` = (fallback key, others passed over, backend that ran)."""
    return _cell(_paths, key)


#: The process-wide tables by the name a recording keeps its own counts under.
_TABLES = {"calls": _calls, "fallbacks": _fallbacks, "paths": _paths, "guard": _guard, "parallel": _parallel,
           "parallel_bytes": _parallel_bytes, "sparse": _sparse, "sparse_dense": _sparse_dense,
           "sparse_error": _sparse_error, "sparse_replaced": _sparse_replaced, "sparse_kept": _sparse_kept,
           "sparse_seconds": _sparse_seconds, "sparse_settings": _sparse_settings, "recomputed": _recomputed}


def count(kind: str, key, n: int = 1, recordings: tuple = ()) -> None:
    """Count ``n`` of ``key`` in the process-wide table ``kind`` (a name of ``_TABLES``) and
    in ``recordings`` (those open in the scope in force). Keys: calls (role, backend id, rule or None);
    fallbacks (role, backend passed over, reason); paths (fallback key, others passed over, backend that
    ran); guard (role, backend, what, ran_on, recomputed); parallel and parallel_bytes (role, kind, mode,
    ranks, ulysses, ring, note); sparse, sparse_dense, sparse_error, sparse_replaced, sparse_kept, sparse_seconds,
    sparse_settings (see their tables); recomputed (role, backend id)."""
    _cell(_TABLES[kind], key).n += n
    for rec in recordings:
        rec.here[kind][key] += n


def _snapshot(table: dict) -> dict:
    return {key: cell.n for key, cell in list(table.items())}


def _since(table: dict, base: dict) -> Counter:
    return Counter({key: cell.n - base.get(key, 0) for key, cell in list(table.items())
                    if cell.n > base.get(key, 0)})


class Recording:
    """Counts for one stretch of work (a generation), from its creation to ``finish()``.
    ``calls``: Counter {(role, backend): n}; ``rules``: Counter {(schedule text, rule label, role, backend): n}
    for the calls a schedule served; ``fallbacks``: Counter {(role, backend passed over,
    reason): n}; ``guard``: Counter {(role, backend, what, ran_on, recomputed): n}; ``seconds``: wall time.
    ``here``: counts only the calls the dispatcher adds to it (``recording()`` makes such one);
    otherwise every call of the process (see the module's docstring)."""

    def __init__(self, here: bool = False):
        self.here = {kind: Counter() for kind in _TABLES} if here else None
        self._start = None if here else {kind: _snapshot(table) for kind, table in _TABLES.items()}
        self._final: dict | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None

    def _now(self, kind: str) -> Counter:
        if self._final is not None:
            return Counter(self._final[kind])
        if self.here is not None:
            return +self.here[kind]
        return _since(_TABLES[kind], self._start[kind])

    def finish(self) -> None:
        """Stop counting: the counts stay as they are now."""
        if self._final is None:
            self._final = {kind: self._now(kind) for kind in _TABLES}
            self.finished = time.perf_counter()

    def mark(self) -> dict:
        """The counts so far, to take a part of the work with ``since`` (one batch of a generation)."""
        return {kind: self._now(kind) for kind in _TABLES}

    def since(self, start: dict, end: dict | None = None) -> "Recording":
        """The counts added between the marks ``start`` and ``end`` (None: now), as a finished Recording."""
        end = self.mark() if end is None else end
        part = Recording(here=True)
        part._final = {kind: end[kind] - start.get(kind, Counter()) for kind in _TABLES}
        part.started, part.finished = self.started, self.finished or time.perf_counter()
        return part

    def _ruled(self) -> Counter:
        return self._now("calls")

    @property
    def calls(self) -> Counter:
        out: Counter = Counter()
        for (role, backend, _), n in self._ruled().items():
            out[(role, backend)] += n
        return out

    @property
    def rules(self) -> Counter:
        return Counter({(rule[0], rule[1], role, backend): n
                        for (role, backend, rule), n in self._ruled().items() if rule is not None})

    @property
    def fallbacks(self) -> Counter:
        return self._now("fallbacks")

    @property
    def guard(self) -> Counter:
        return self._now("guard")

    @property
    def recomputed(self) -> Counter:
        """{(role, backend): n} of the calls (in ``calls`` too) that ran inside a backward pass, recomputed
        by activation checkpointing; ``calls`` minus these are the forward calls."""
        return self._now("recomputed")

    @property
    def parallel(self) -> dict:
        """{(role, kind, mode, ranks, ulysses, ring, note): (calls, bytes sent)} for calls split over
        ranks (``lib_attn.parallel``); empty when none was."""
        sent = self._now("parallel_bytes")
        return {key: (n, sent.get(key, 0)) for key, n in self._now("parallel").items()}

    @property
    def sparse(self) -> SparseReport | None:
        """What sparse attention did (``lib_attn.sparse``); None when it served no call."""
        return SparseReport.from_tables({kind: self._now(kind) for kind in _TABLES if kind.startswith("sparse")})

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    @property
    def kernels(self) -> dict[str, str]:
        """What each backend that ran was, with its version and variant."""
        used = {backend for _, backend in self.calls}
        return {b: " / ".join(sorted(_kernels.get(b, {b}))) for b in sorted(used)}

    @property
    def paths(self) -> dict:
        """{fallback key: {(((id, reason), ...) also passed over, id that ran)}} for the fallbacks counted."""
        counted = self._now("paths")
        out: dict = {}
        for fallback_key, others, ran in counted:
            out.setdefault(fallback_key, set()).add((others, ran))
        return {key: frozenset(paths) for key, paths in out.items()}

    @property
    def tuned(self) -> set:
        """(role, backend id) pairs that ran where tuning chose them (for at least one call kind)."""
        return {pair for pair in self.calls if pair in _tuned}

    def total(self, role: str | None = None) -> int:
        return sum(n for (r, _), n in self.calls.items() if role is None or r == role)

    def __repr__(self):
        return f"Recording(calls={dict(self.calls)}, rules={dict(self.rules)}, fallbacks={dict(self.fallbacks)}, guard={dict(self.guard)})"


#: Everything counted in this process.
lifetime = Recording()
_last: Recording | None = None


def note_kernel(backend: str, description: str) -> None:
    _kernels.setdefault(backend, set()).add(description)


def note_tuned(role: str, backend: str) -> None:
    _tuned.add((role, backend))


def forget_tuned() -> None:
    _tuned.clear()


@contextlib.contextmanager
def recording(into: Recording | None = None):
    """Count the calls of this thread or task into a fresh Recording for the ``with`` block (and those
    of ``use`` blocks inside it); yields it. Other threads' calls are not counted.

    ``into``: a recording an earlier block of this kind made, counted into again and left open (a
    host's generation that runs as several pieces of work, each in its own block); the host calls
    its ``finish()`` when the generation ends."""
    global _last
    if into is not None and into.here is None:
        raise ValueError("recording(into=...) takes a recording made by recording(), which counts its own "
                         "thread's calls; a Recording() made directly already counts every thread's")
    rec = into if into is not None else Recording(here=True)
    outer = _scope.current()
    try:
        with _scope.entered(_scope.Scope(outer.config, outer.where, (*outer.recordings, rec))):
            yield rec
    finally:
        if into is None:
            rec.finish()
            _last = rec


def last_recording() -> Recording | None:
    return _last
