"""Tuning: rank the backends that take a call kind by measuring them on its first call, check each
one's output, and keep the ranking on disk so that later processes do not measure again.

What runs, per call signature (the key the dispatcher caches decisions under), under ``no_grad``,
with no copy of the call's inputs:

* each candidate once on ``check.probe``'s copies of a part of the call (the whole call when small,
  whose output is then checked as below), compared with the caller's tensors bit for bit: a
  candidate that writes into them is rejected there, and so never runs on the caller's tensors;
* each candidate that passed, once on the *timed part* (``timed_part``): views of the caller's
  tensors, the whole call up to ``TIMED_WORK`` FLOPs, else its first batch items and heads at full
  lengths with about that much work (never fewer heads than keep every SM busy for
  ``TILES_PER_UNIT`` waves of query tiles). That call is checked on its sampled rows, its inputs
  are watched (``check.Watch``: a write into them is caught and undone), and it warms the kernel up (lazy
  initialisation, autotuning, JIT compiles stay out of the timings). A candidate whose checked call
  took more than ``SLOWER`` times the fastest checked call, or longer than ``BUDGET_S`` and longer
  than the fastest, stops here (that call is its time);
* one timed call of each other candidate; those more than ``SLOWER`` times slower than the fastest
  of these, or longer than ``BUDGET_S``, stop here;
* up to ``REPS`` - 2 rounds of one timed call per remaining candidate, as many as fit in
  ``BUDGET_S``; rounds interleave the candidates, so drift affects them alike.

Why a part's time ranks the kernels as the whole call would: a fused kernel splits a call into
query tiles per (batch, head) and runs them in waves over the device's processors; with the same
lengths, dtype and head size, each (batch, head) is the same code on the same amount of work, so
once the part fills several waves its time grows in proportion to batch x heads. Stored timings are
the part's medians divided by its share of the call. So a long video call costs one small probe and
one part-sized call per candidate, about one more of each that may win, and at most ``BUDGET_S`` of
rounds, and its extra memory is the probe's copies (at most ``check.PROBE_BYTES``), the reference's
blocks (``check.BLOCK_BYTES``) and one candidate's output of the part at a time (never more than the
call's own output). CUDA events time a GPU, ``time.perf_counter`` anything else. The fastest
median wins.

Rankings are kept in the tuning file (``tuning_file``), so that later processes do not measure again.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from . import _compat
from . import check as _check
from . import tuning_file
from .kernels.base import failure_text, is_sticky
from .shapes import attention_flops

log = logging.getLogger("lib_attn")

REPS = 5
BUDGET_S = 0.3
SLOWER = 25


@dataclass(frozen=True)
class Candidate:
    """One backend that takes the call: ``run`` takes (q, k, v, mask, scale) as the caller passes
    them; ``dtype`` is the dtype it computes in (after a cast)."""

    id: str
    run: object = field(repr=False)
    dtype: torch.dtype = torch.float32
    approximate: bool = False


@dataclass(frozen=True)
class Ranking:
    """``timings``: backend id -> median seconds, fastest first; ``rejected``: id -> reason;
    ``source``: ``"measured"`` (now) or ``"stored"`` (from the file); ``keep``: False when a candidate
    ran out of memory, which may not happen on the next run, so the ranking is not stored."""

    source: str
    timings: dict
    rejected: dict
    keep: bool = True

    @property
    def winner(self) -> str | None:
        return next(iter(self.timings), None)


# --- when tuning applies ---------------------------------------------------------------------

def enabled(mode: str, device_type: str) -> bool:
    """Whether configuration ``mode`` measures on this device type."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def blocked(device_type: str) -> str | None:
    """Why kernels must not be measured now (tracing, capture, backward), or None."""
    if _compat.compiling():
        return "torch.compile or TorchScript is tracing"
    if _compat.in_backward():
        return "inside a backward pass"
    if _compat.capturing(device_type):
        return "a CUDA graph is being captured"
    return None


# --- measuring --------------------------------------------------------------------------------

class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def times(self, fn, n: int) -> list:
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            self.sync()
            return [s.elapsed_time(e) * 1e-3 for s, e in events]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out


def ms_text(seconds: float) -> str:
    """A median for people: ``2188 ms``, ``45.6 ms``, ``0.123 ms``."""
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _median(values: list) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


#: Work (forward FLOPs, ``shapes.attention_flops``) above which candidates are timed on a part of
#: the call, per device type (others: the CPU's).
TIMED_WORK = {"cuda": 2e12, "cpu": 4e9}
#: A timed part keeps at least this many query tiles of ``TILE_ROWS`` rows per processor (an SM on
#: CUDA, a thread elsewhere), so that the device runs full waves as it does on the whole call.
TILES_PER_UNIT = 4
TILE_ROWS = 128


def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def timed_part(q, k, v, mask, layout: str) -> tuple[tuple, float]:
    """((q, k, v, mask), share): the part of the call candidates are timed on, as views of the
    caller's tensors, and the share of the call's work it is. The whole call (share 1) up to
    ``TIMED_WORK``; above it the first batch items and heads whose work is about ``TIMED_WORK``, at
    the call's full lengths, and never fewer heads than keep the device full."""
    bq = q.transpose(1, 2) if layout == "bshd" else q
    b, h, n, d = bq.shape
    kv = k.shape[1] if layout == "bshd" else k.shape[2]
    per_head = attention_flops(1, 1, n, kv, d)
    limit = TIMED_WORK.get(q.device.type, TIMED_WORK["cpu"])
    if b * h * per_head <= limit:
        return (q, k, v, mask), 1.0
    full = -(-_processors(q.device) * TILES_PER_UNIT // -(-n // TILE_ROWS))
    units = min(b * h, max(1, full, int(limit // per_head)))
    batch, heads = (1, units) if units <= h else (-(-units // h), h)
    return _check.part(q, k, v, mask, layout, batch, heads, n, kv), batch * heads / (b * h)


def measure(candidates: list, q, k, v, mask, scale, layout: str) -> Ranking:
    """Check and time every candidate on this call (see the module's docstring for the bounds)."""
    timer = _Timer(q.device)
    samples, rejected, first = {}, {}, {}
    with torch.no_grad():
        probe = _check.probe(q, k, v, mask, layout)
        part, share = timed_part(q, k, v, mask, layout)
        rows = _check.samples(part[0], layout)
        ref = _check.reference(*part, scale, layout, rows)
        calls = {c.id: (lambda run=c.run: run(*part, scale)) for c in candidates}

        def checked(fn, limit: float) -> tuple[str, float]:
            """A run of ``fn`` on the timed part (or the whole probe): its verdict and its time."""
            timer.sync()
            t0 = time.perf_counter()
            out = fn()
            timer.sync()
            return _check.check(out, part[0].shape, layout, rows, ref, limit), time.perf_counter() - t0

        for c in candidates:  # the checked call, which also warms the kernel up
            limit = _check.bound(c.dtype, q.device.type, c.approximate)
            try:
                if not probe.untouched():  # the last candidate wrote into the copies
                    probe = probe.renewed()
                if probe.whole:
                    reason, t = checked(lambda: c.run(*probe.args, scale), limit)
                else:
                    c.run(*probe.args, scale)
                if not probe.untouched():
                    reason = f"{_check.CHECK_FAILED}: {_check.WROTE_INPUTS}"
                elif not probe.whole:
                    # On the caller's tensors, now that the probe saw it leave its inputs alone.
                    watch = _check.Watch(part[:3])
                    reason, t = checked(calls[c.id], limit)
                    if watch.changed():
                        reason = f"{_check.CHECK_FAILED}: {watch.undo()}"
                        if reason.endswith(_check.WROTE_AT_FULL_SIZE):  # not restored: what the others now see
                            ref = _check.reference(*part, scale, layout, rows)
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a reason, as at run time
                if is_sticky(exc):
                    raise
                reason = failure_text(exc)
            if reason:
                rejected[c.id] = reason
            else:
                first[c.id] = t
        _race(first, samples, rejected, calls, timer)
    # A part's time stands for the whole call's: time grows with batch x heads once the device is full.
    timings = {bid: _median(ts) / share for bid, ts in samples.items() if ts}
    ordered = dict(sorted(timings.items(), key=lambda item: item[1]))
    return Ranking("measured", ordered, rejected, not any("out of memory" in r.lower() for r in rejected.values()))


def _race(first: dict, samples: dict, rejected: dict, calls: dict, timer: _Timer) -> None:
    """Time the candidates that passed their checked call (``first``: its time), into ``samples``."""

    def timed(bid: str, n: int) -> None:
        try:
            samples[bid] += timer.times(calls[bid], n)
        except Exception as exc:  # noqa: BLE001 - as in measure
            if is_sticky(exc):
                raise
            del samples[bid]
            rejected[bid] = failure_text(exc)

    if not first:
        return
    fastest = min(first.values())
    for bid, t in first.items():
        samples[bid] = []
        if bid != min(first, key=first.get) and (t > SLOWER * fastest or (t > BUDGET_S and t > fastest)):
            # Clearly slower, even counting its one-time costs: the checked call is its time.
            samples[bid] = [t]
    # Rounds over the candidates still in the race, so that drift affects them alike.
    racing = [bid for bid in first if not samples[bid]]
    for bid in racing:
        timed(bid, 1)
    racing = [bid for bid in racing if bid in samples]
    if racing:
        best = min(samples[bid][0] for bid in racing)
        racing = [bid for bid in racing if samples[bid][0] <= min(SLOWER * best, BUDGET_S)]
        round_s = sum(samples[bid][0] for bid in racing)
        for _ in range(min(REPS - 2, int(BUDGET_S / max(round_s, 1e-9)))):
            for bid in racing:
                if bid in samples:
                    timed(bid, 1)


def rank(spec, fp32: str, candidates: list, inputs: tuple | None) -> Ranking | None:
    """The ranking of ``candidates`` for a call: stored when the file has every candidate of this
    signature on this machine; else measured on ``inputs`` (q, k, v, mask, scale) and stored; None
    when nothing is stored and ``inputs`` is None (``explain`` runs no kernel)."""
    ids = [c.id for c in candidates]
    with tuning_file.lock:
        found = tuning_file.stored(spec, fp32, ids)
        if found is not None:
            return Ranking("stored", *found)
        if inputs is None:
            return None
        try:
            ranking = measure(candidates, *inputs, layout=spec.layout)
        except Exception as exc:  # noqa: BLE001 - e.g. no memory left for the reference: never break a call
            if is_sticky(exc):
                raise
            log.warning("attention tuning: could not measure %s (%s); the fixed order serves it",
                        tuning_file.signature(spec, fp32), failure_text(exc))
            return None
        if ranking.keep:
            tuning_file.record(spec, fp32, ids, ranking.timings, ranking.rejected)
    log.info("attention tuning: %s: %s", tuning_file.signature(spec, fp32), ", ".join(
        [f"{i} {ms_text(t)}" for i, t in ranking.timings.items()]
        + [f"{i} rejected ({r})" for i, r in ranking.rejected.items()]))
    return ranking
