"""What runs for a call signature: ``decide`` walks a chain and keeps the first backend that takes the
call, with every rejection; ``decide_tuned`` asks ``tune`` to rank the backends of the chain that take
it and keeps the fastest correct one. A ``Decision`` carries the kernel call, adapted to the
caller's layout and dtype, and the counters the hot path increments.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import _compat
from . import config as _config
from . import guard as _guard
from . import scope as _scope
from . import stats
from . import tune as _tune
from .kernels import REGISTRY, Status, status
from .spec import CallSpec

#: (backend id, CallSpec) whose output passed the guard's first check: a decision made again for them
#: (decisions are dropped at every configuration change, which a webui makes per generation) is
#: trusted at once.
trusted: set = set()


@dataclass
class Decision:
    """What runs for a call signature. ``backend``: the id that runs; ``rejected``: (id, reasons) for
    every backend ahead of it in the chain; ``variant``: the package's kernel (e.g. "FA3");
    ``cast``: the dtype fp32 inputs are cast to, or None; ``preferred``: the backend the configuration
    put first (the first available one for a default chain); ``source``: how the backend was chosen,
    ``"measured"`` (tuning ranked the candidates on this call), ``"stored"`` (the ranking came from
    the tuning file) or ``"order"`` (the chain's fixed order); ``timings``: backend id -> median
    seconds of each candidate tuning ranked, fastest first (empty under ``"order"``). A candidate
    tuning rejected is in ``rejected`` with its reason (``output check failed: ...`` or its error), and
    so is one the guard rejected on this signature. ``checked``: the backend's output passed its check
    on this signature (or needs none); ``countdown``: calls before the guard looks at one."""

    backend: str
    rejected: list = field(default_factory=list)
    variant: str = ""
    cast: torch.dtype | None = None
    preferred: str | None = None
    spec: CallSpec | None = None
    run: object = field(default=None, repr=False)
    count_key: tuple = ()
    fallback_key: tuple | None = None
    source: str = "order"
    timings: dict = field(default_factory=dict)
    final: bool = field(default=True, repr=False)  # False: decided where tuning was blocked, not cached
    checked: bool = field(default=True, repr=False)
    countdown: int = field(default=_guard.NEVER, repr=False)
    late: object = field(default=None, repr=False)  # the guard's device-side count (CUDA, mode on)
    #: While sparse attention is on: the ``lib_attn.sparse_plan.Plan`` that serves every call of the
    #: signature (the guard's path hands each call to it), else None.
    plan: object = field(default=None, repr=False)
    #: The counters of ``count_key`` and ``fallback_key`` (and of the fallback's whole path: every
    #: backend passed over and the one that ran): the hot path counts with one increment each.
    call_cell: object = field(default=None, init=False, repr=False, compare=False)
    fallback_cell: object = field(default=None, init=False, repr=False, compare=False)
    path_cell: object = field(default=None, init=False, repr=False, compare=False)
    path_key: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.call_cell = stats.call_cell(self.count_key) if self.count_key else None
        self.fallback_cell = None if self.fallback_key is None else stats.fallback_cell(self.fallback_key)
        if self.fallback_key is not None:
            others = tuple((bid, "; ".join(r)) for bid, r in self.rejected if bid != self.preferred)
            self.path_key = (self.fallback_key, others, self.backend)
            self.path_cell = stats.path_cell(self.path_key)

    @property
    def fallback(self) -> bool:
        return self.fallback_key is not None

    def reasons_for(self, backend_id: str) -> list:
        for bid, reasons in self.rejected:
            if bid == backend_id:
                return reasons
        return []

    def __str__(self) -> str:
        lines = [f"{self.backend}{f' ({self.variant})' if self.variant else ''}"
                 f"{f', inputs cast to {self.cast}' if self.cast else ''}"]
        if self.source != "order":
            lines[0] += f" [tuned: {self.source}]"
        if self.spec is not None and self.spec.requires_grad:
            lines.append(f"  gradients: {self.backend}'s own backward")
        lines += [f"  {bid}: median {_tune.ms_text(t)}" for bid, t in self.timings.items()]
        lines += [f"  passed over {bid}: {'; '.join(reasons)}" for bid, reasons in self.rejected]
        return "\n".join(lines)


def verdict(spec: CallSpec, bid: str, st: Status, fp32: str, asked: bool, failed: dict | None,
             excluded: dict | None = None):
    """(reasons, cast, run_spec) of one backend for ``spec``; no reasons means it takes the call."""
    if not st.available:
        return [f"not available: {st.reason}"], None, spec
    if failed and bid in failed:
        return [f"failed at run time: {failed[bid]}"], None, spec
    if excluded and bid in excluded:
        return [excluded[bid]], None, spec
    backend = REGISTRY[bid]
    cast, run_spec = None, spec
    if spec.dtype == torch.float32 and fp32 == "cast" and not backend.takes_dtype(torch.float32, spec.device.type):
        cast = spec.device.half_dtype
        run_spec = spec.with_dtype(cast)
    reasons = backend.reasons(run_spec, asked=asked)
    if fp32 == "keep" and spec.dtype == torch.float32:
        reasons = [r + " (fp32 policy: keep)" if r.startswith("dtype") else r for r in reasons]
    return reasons, cast, run_spec


def _preferred(chain, statuses: dict | None, explicit: bool) -> str | None:
    if explicit:
        return chain[0]
    return next((bid for bid in chain if (statuses[bid] if statuses is not None else status(bid)).available), None)


def decide(spec: CallSpec, chain, statuses: dict | None = None, fp32: str = "cast", explicit: bool = False,
           failed: dict | None = None, excluded: dict | None = None) -> Decision:
    """Walk ``chain`` for ``spec`` and return the first backend that takes it.

    ``statuses`` maps ids to probe results (the real probes when None); ``explicit`` says the chain's
    head was named by the user, so its first entry is the preferred one even when not installed;
    ``failed`` maps ids to a run-time failure that demoted them for this signature; ``excluded``
    maps ids to the reason tuning rejected them for it.
    """
    rejected = []
    preferred = _preferred(chain, statuses, explicit)
    for bid in chain:
        st: Status = statuses[bid] if statuses is not None else status(bid)
        reasons, cast, run_spec = verdict(spec, bid, st, fp32, explicit and bid == chain[0], failed, excluded)
        if reasons:
            rejected.append((bid, reasons))
            continue
        return _decision(REGISTRY[bid], rejected, cast, preferred, spec, run_spec)
    raise ValueError(f"no backend takes this call ({spec.describe()}): "
                     + "; ".join(f"{bid}: {', '.join(r)}" for bid, r in rejected))


def decide_tuned(spec: CallSpec, chain, pool, fp32: str, explicit: bool, failed: dict | None,
                 inputs: tuple | None, excluded: dict | None = None) -> Decision | None:
    """Rank the backends of ``pool`` that take ``spec`` (``tune.rank``) and decide the fastest correct
    one; None when none takes it or nothing is stored and ``inputs`` is None. ``chain`` is the full
    chain in force, ``inputs`` the call's (q, k, v, mask, scale) to measure on; ``excluded`` as for
    ``decide``."""
    rejected, takers = [], {}
    for bid in pool:
        reasons, cast, run_spec = verdict(spec, bid, status(bid), fp32, explicit and bid == chain[0], failed,
                                           excluded)
        if reasons:
            rejected.append((bid, reasons))
        else:
            takers[bid] = (REGISTRY[bid], cast, run_spec)
    if not takers:
        return None
    candidates = [_tune.Candidate(bid, wrap(b.runner(rs), spec.layout != b.layout, cast), cast or spec.dtype,
                                  b.approximate) for bid, (b, cast, rs) in takers.items()]
    ranking = _tune.rank(spec, fp32, candidates, inputs)
    if ranking is None:
        return None
    if ranking.winner is None:  # every candidate failed its check: the rest of the chain, in order
        try:
            return decide(spec, chain, fp32=fp32, explicit=explicit, failed=failed,
                          excluded={**(excluded or {}), **ranking.rejected})
        except ValueError:  # nothing left: a check must never stop a generation that ran without it
            return decide(spec, chain, fp32=fp32, explicit=explicit, failed=failed)
    rejected += [(bid, [reason]) for bid, reason in ranking.rejected.items()]
    preferred = _preferred(chain, None, explicit)
    if preferred in ranking.timings:
        preferred = ranking.winner  # it took the call and passed its check: being slower is no fallback
    backend, cast, run_spec = takers[ranking.winner]
    dec = _decision(backend, rejected, cast, preferred, spec, run_spec, ranking.source)
    dec.timings = dict(ranking.timings)
    return dec


def _decision(backend, rejected, cast, preferred, spec, run_spec, source: str = "order") -> Decision:
    variant = backend.variant(run_spec)
    run = wrap(backend.runner(run_spec), spec.layout != backend.layout, cast)
    if spec.requires_grad:
        run = counting_recomputed(run, (spec.role, backend.id), (spec.role, backend.id, spec.rule))
    fallback_key = None
    if preferred is not None and preferred != backend.id:
        reasons = next((r for bid, r in rejected if bid == preferred), [])
        fallback_key = (spec.role, preferred, "; ".join(reasons))
    stats.note_kernel(backend.id, " ".join(p for p in (backend.id, status(backend.id).version, f"({variant})" if variant else "") if p))
    if source != "order":
        stats.note_tuned(spec.role, backend.id)
    # The decision outlives the call: it must not keep the call's tensors alive.
    spec = replace(spec, tensors=None)
    dec = Decision(backend.id, rejected, variant, cast, preferred, spec, run, (spec.role, backend.id, spec.rule),
                   fallback_key, source)
    # Tuning checked what it ranked; anything else is checked on its first call, once per process
    # (decisions are dropped at every configuration change, which a webui makes per generation).
    dec.checked = source != "order" or (backend.id, spec) in trusted
    dec.countdown = _guard.countdown(_config.current().guard, backend.id, backend.approximate, dec.checked)
    return dec


def counting_recomputed(run, key: tuple, call_key: tuple):
    """``run``, counting the calls it makes inside a backward pass (activation checkpointing recomputes the
    forward there) under ``key`` = (role, backend id). Only decisions for calls that need gradients carry
    it: an inference call adds nothing. ``call_key``: the decision's ``count_key``, counted here for a
    call that checkpointing stops once it has what it needs (the dispatcher never sees that call end)."""
    cell, call_cell = stats.recomputed_cell(key), stats.call_cell(call_key)
    in_backward = _compat.in_backward

    def counted(stopped: bool) -> None:
        cell.n += 1
        call_cell.n += stopped
        for rec in _scope.current().recordings:
            rec.here["recomputed"][key] += 1
            rec.here["calls"][call_key] += stopped

    def run_counted(q, k, v, mask, scale):
        if not in_backward():
            return run(q, k, v, mask, scale)
        try:
            out = run(q, k, v, mask, scale)
        except _compat.STOP_RECOMPUTATION:
            counted(True)
            raise
        counted(False)
        return out
    return run_counted


def wrap(run, transpose: bool, cast):
    """Adapt a backend's kernel call to the caller's layout and dtype; the common case adds nothing."""
    if not transpose and cast is None:
        return run
    if cast is None:
        def run_transposed(q, k, v, mask, scale):
            return run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).transpose(1, 2)
        return run_transposed

    def run_cast(q, k, v, mask, scale):
        dtype = q.dtype
        if transpose:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = run(q.to(cast), k.to(cast), v.to(cast), mask, scale).to(dtype)
        return out.transpose(1, 2) if transpose else out
    return run_cast
