"""What runs a call signature while sparse attention is on: a ``Plan``, which the dispatcher's decision
for the signature carries, and which sends each call to the sparse backend or to the dense chain.

* **Eligible or not** (``dense_reason``), once per signature and position: sparse takes denoiser
  self-attention without a mask and with at least ``min_tokens`` queries, outside the dense windows,
  on a sparse backend that takes it. Every other call runs the dense chain (the tuned dense decision
  the configuration makes for it), counted under its reason.
* **Per call kind** (``Kind``: the signature, the block and the band of steps, ``BANDS`` of them), the
  sparsest setting within the budget: at the kind's first call the backend's ladder is measured on the
  sampled rows against an exact reference (``measure.routed_errors``: every setting from one set of
  exact scores, for a backend that states its routing; else a run of the kernel per setting, from the
  sparsest, until one is within the budget). A kind no setting brings within the budget runs dense,
  counted as ``over budget: 0.23 > 0.15`` (the error of the densest setting tried). The calls of a
  kind that runs sparse have their output measured (``measure.output_error``) at the first call and
  every ``RECHECK_EVERY`` calls after; one over the budget is recomputed dense and the kind moves to
  its next denser setting, or to dense when none is left.
* **Faults** are caught as for every kernel: the first sparse call of a plan runs on copies of a part
  of the call first (``check.probe``), and its full-size run is bracketed by checksums; every sparse
  output is screened for non-finite values (on CUDA through the guard's device-side count, read
  later). A backend caught is out for the signature, counted in the guard's table, and the call is
  recomputed dense.

The counts go to ``stats`` (``sparse``, ``sparse_dense``, ``sparse_error``, ``sparse_kept``,
``sparse_seconds``), in the process and in the recordings open where the call runs.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from .. import check as _check
from .. import guard as _guard
from .. import schedule as _schedule
from .. import scope as _scope
from .. import stats
from ..decision import verdict
from ..kernels import REGISTRY, SPARSE_IDS, status
from ..kernels.base import failure_text
from ..spec import NO_MASK
from . import measure

log = logging.getLogger("lib_attn")

#: The steps of a pass fall in this many bands, each a call kind of its own (attention concentrates
#: differently early and late in sampling).
BANDS = 5
#: A kind that runs sparse has one call in this many measured after its first.
RECHECK_EVERY = 4
DENOISER = ("unet", "dit")
OVER_BUDGET = "over budget"
#: A call whose error could not be measured (exact attention on the sampled rows was not finite): it runs
#: dense and its kind keeps no setting, so the next call of the kind measures again.
NOT_MEASURED = "not measured: non-finite values"


def band_of(progress) -> int | None:
    return None if progress is None else min(int(progress * BANDS), BANDS - 1)


def band_text(band) -> str:
    return "" if band is None else f"{band * 100 // BANDS}-{(band + 1) * 100 // BANDS}%"


def kind_label(block, band) -> str:
    """A call kind as the readout names it: ``block 3, 20-40%``; ``any`` when neither is known."""
    parts = ([f"block {block}"] if block is not None else []) + ([band_text(band)] if band is not None else [])
    return ", ".join(parts) or "any"


def unknown_windows(windows, here, spec) -> list[str]:
    """The dense windows (rules) that would take this call's kind but ask for a position ``here`` does not
    know: they do not hold (as a schedule's rule does not), and the readout names them."""
    call_kind = _schedule.kind(spec.role, spec.q_len, spec.kv_len, here.joint)
    return [r.label for r in windows if r.takes(spec.role, call_kind) and (
        (r.steps is not None and here.progress is None) or (r.sigmas is not None and here.sigma is None)
        or (r.blocks is not None and (here.block is None or here.blocks is None)))]


def unknown_text(labels) -> str:
    return f"position unknown: dense window {', '.join(labels)} not applied" if labels else ""


def ring_reason(backend, spec) -> str:
    """Why a ring step of a call that would go sparse runs dense (context parallelism)."""
    if not backend.gives_lse(spec):
        return "returns no log-sum-exp (needed by ring steps): sparse attention runs under Ulysses only"
    return "held to its budget on whole calls: ring steps run dense, Ulysses runs it sparse"


def over_budget(error: float, budget: float) -> str:
    """The reason a kind over ``budget`` runs dense, with as many digits as show the error above it."""
    if not math.isfinite(error):
        return f"{OVER_BUDGET}: no finite error"
    limit = f"{budget:g}"
    for digits in range(3, 18):
        shown = f"{error:.{digits}g}"
        if float(shown) > float(limit):
            break
    return f"{OVER_BUDGET}: {shown} > {limit}"


# --- which calls may go sparse ----------------------------------------------------------------

def _window(cfg, token, spec) -> str:
    """The label of the dense window that takes this call, or ""."""
    positional = cfg.positional
    own = len(cfg.schedule.rules) if cfg.schedule is not None else 0
    if positional is None or token is None:
        return ""
    joint, indices = token
    call_kind = _schedule.kind(spec.role, spec.q_len, spec.kv_len, joint)
    for i in indices:
        if i >= own and positional.rules[i].takes(spec.role, call_kind):
            return positional.rules[i].label
    return ""


def dense_reason(cfg, spec, token, fp32: str) -> tuple[str, str | None, object]:
    """(reason the call stays dense or "", the sparse backend that takes it, its cast dtype or None)."""
    settings = cfg.sparse
    if spec.role not in DENOISER:
        return f"{spec.role} calls stay dense", None, None
    if spec.q_len != spec.kv_len:
        return "cross-attention", None, None
    if spec.mask != NO_MASK:
        return f"{spec.mask} mask", None, None
    if spec.exact:
        return "exact attention asked for", None, None
    if spec.requires_grad:
        return "gradients needed (sparse runs inference only)", None, None
    if spec.q_len < settings.min_tokens:
        return f"below min_tokens: {spec.q_len} < {settings.min_tokens}", None, None
    window = _window(cfg, token, spec)
    if window:
        return f"dense window: {window}", None, None
    candidates = SPARSE_IDS if settings.method == "auto" else (settings.method,)
    why = []
    for bid in candidates:
        reasons, cast, _ = verdict(spec, bid, status(bid), fp32, settings.method != "auto", None)
        if not reasons:
            return "", bid, cast
        why.append(f"{bid}: {'; '.join(reasons)}")
    return "; ".join(why) or "no sparse backend", None, None


# --- call kinds ---------------------------------------------------------------------------------

@dataclass
class Kind:
    """A call kind's state: ``knob`` the setting it runs at (None: dense, for ``reason``); ``rungs``
    what is left of its ladder, denser settings first to last; ``calls`` since its last measurement."""

    knob: object = None
    reason: str = ""
    rungs: tuple = ()
    calls: int = 0


#: (plan identity, block, band) -> Kind; kept across the dispatcher's decisions (a webui re-applies
#: its settings every generation), dropped by ``forget``.
_kinds: dict = {}


def forget() -> None:
    _kinds.clear()


class Plan:
    """One signature's sparse plan (see the module). ``reason``: why every call of it stays dense ("":
    it may go sparse); ``backend``: the sparse backend's id; ``dense``: ``dense(q, k, v, mask, scale)``
    runs a call on the dense chain (the dispatcher's), whose decision the dispatcher keeps under
    ``dense_key``."""

    dense_key = None

    def __init__(self, cfg, spec, reason: str, backend: str | None, cast, dense):
        self.settings = cfg.sparse
        self.spec = spec
        self.reason = reason
        self.backend = backend
        self.dense = dense
        self.identity = (self.settings.text, spec, backend)
        self.cast = cast
        positional = cfg.positional
        own = len(cfg.schedule.rules) if cfg.schedule is not None else 0
        self.windows = positional.rules[own:] if positional is not None else ()
        self.probed = False
        self.late = None
        if backend is not None:
            b = REGISTRY[backend]
            self.kernel = b
            self.run_sparse = _adapted(b, spec.layout, cast)
            self.budget = self.settings.budget
            variant = b.variant(spec)
            stats.note_kernel(backend, " ".join(p for p in (backend, status(backend).version,
                                                            f"({variant})" if variant else "") if p))

    # -- the call ---------------------------------------------------------------------------------

    def __call__(self, q, k, v, mask, scale):
        started = time.perf_counter()
        recordings = _scope.current().recordings
        stats.count("sparse_settings", (self.settings.text, self.settings.budget), 1, recordings)
        if self.reason:
            out, part = self._dense(self.reason, q, k, v, mask, scale, recordings), "dense"
        else:
            out, part = self._kind_call(q, k, v, scale, recordings)
        if q.device.type == "cpu":  # elsewhere kernels run asynchronously: their time is not read here
            stats.count("sparse_seconds", (part,), time.perf_counter() - started, recordings)
        return out

    def _dense(self, reason: str, q, k, v, mask, scale, recordings):
        stats.count("sparse_dense", (self.spec.role, reason), 1, recordings)
        return self.dense(q, k, v, mask, scale)

    def _kind_call(self, q, k, v, scale, recordings):
        here = _scope.current().where
        block, band = here.block, band_of(here.progress)
        key = (self.identity, block, band)
        kind = _kinds.get(key)
        fresh = kind is None
        if fresh:
            kind = _kinds[key] = Kind()
            out = self._calibrate(kind, q, k, v, scale)
            if kind.reason == NOT_MEASURED:
                del _kinds[key]
        else:
            out = None
        if kind.knob is None:
            return self._dense(kind.reason, q, k, v, None, scale, recordings), "dense"
        if out is None:
            out = self._sparse(kind, q, k, v, scale)
            if out is None:  # a fault: the plan is dense from now on
                return self._dense(self.reason, q, k, v, None, scale, recordings), "dense"
        label = kind_label(block, band)
        unknown = unknown_windows(self.windows, here, self.spec) if self.windows else ()
        if unknown:
            label = f"{label}; {unknown_text(unknown)}"
        kind.calls += 1
        if fresh or kind.calls >= RECHECK_EVERY:
            kind.calls = 0
            error = measure.output_error(out.out, q, k, v, scale, self.spec.layout)
            self._record(label, kind.knob, error, out.kept, recordings)
            if math.isnan(error):  # nothing measured: this call runs dense and the next one is measured
                kind.calls = RECHECK_EVERY - 1
                return self._dense(NOT_MEASURED, q, k, v, None, scale, recordings), "dense"
            if not error <= self.budget:
                self._denser(kind, error)
                stats.count("sparse_dense", (self.spec.role, over_budget(error, self.budget)), 1, recordings)
                return self.dense(q, k, v, None, scale), "dense"
        stats.count("sparse", (self.spec.role, self.backend, label, kind.knob.text), 1, recordings)
        stats.count("calls", (self.spec.role, self.backend, self.spec.rule), 1, recordings)
        return out.out, "sparse"

    # -- calibration --------------------------------------------------------------------------------

    def _ladder(self) -> tuple:
        knob = self.settings.knob
        return self.kernel.ladder(knob) if self.settings.calibrate else (knob,)

    def _calibrate(self, kind: Kind, q, k, v, scale):
        """Put ``kind`` at the sparsest setting of the ladder within the budget (or dense); returns the
        call's sparse result when calibration ran the kernel at that setting, else None."""
        ladder = self._ladder()
        routings = self._routings(ladder, q, k, scale)
        if routings is not None:
            errors = measure.routed_errors(q, k, v, scale, self.spec.layout, routings)
            for i, error in enumerate(errors):
                if math.isnan(error):
                    kind.reason = NOT_MEASURED
                    return None
                if error <= self.budget:
                    kind.knob, kind.rungs = ladder[i], ladder[i + 1:]
                    return None
            kind.reason = over_budget(errors[-1], self.budget)
            return None
        error = math.inf
        for i, knob in enumerate(ladder):
            kind.knob = knob
            result = self._sparse(kind, q, k, v, scale)
            if result is None:
                kind.knob, kind.reason = None, self.reason
                return None
            error = measure.output_error(result.out, q, k, v, scale, self.spec.layout)
            if math.isnan(error):
                kind.knob, kind.reason = None, NOT_MEASURED
                return None
            if error <= self.budget:
                kind.rungs = ladder[i + 1:]
                return result
        kind.knob, kind.reason = None, over_budget(error, self.budget)
        return None

    def _routings(self, ladder, q, k, scale):
        """Each setting's routing (q, k as the kernel sees them), or None when the backend states none."""
        if not self.kernel.states_routing:
            return None
        qb, kb = (t.transpose(1, 2) if self.spec.layout == "bshd" else t for t in (q, k))
        if self.cast is not None:
            qb, kb = qb.to(self.cast), kb.to(self.cast)
        first = self.kernel.routing(qb, kb, scale, ladder[0])
        if first is None:
            return None
        return [first] + [self.kernel.routing(qb, kb, scale, knob) for knob in ladder[1:]]

    def _denser(self, kind: Kind, error: float) -> None:
        if kind.rungs:
            kind.knob, kind.rungs = kind.rungs[0], kind.rungs[1:]
        else:
            kind.knob, kind.reason = None, over_budget(error, self.budget)

    def _record(self, label: str, knob, error: float, kept, recordings) -> None:
        role = self.spec.role
        shown = round(error, 4) if math.isfinite(error) else error
        stats.count("sparse_error", (role, self.backend, label, knob.text, shown), 1, recordings)
        share = float(kept) if kept is not None else math.nan
        if math.isfinite(share):
            stats.count("sparse_kept", (role, self.backend, label, knob.text), share, recordings)

    # -- one sparse run, with the checks every kernel gets --------------------------------------------

    def _sparse(self, kind: Kind, q, k, v, scale):
        """The sparse result at ``kind.knob``, or None when the backend was caught (then dense for good)."""
        try:
            if not self.probed:
                fault = self._probe(kind.knob, q, k, v, scale)
                if fault:
                    return self._caught(fault)
                before = _check.checksums(q, k, v)
                result = self.run_sparse(q, k, v, scale, kind.knob)
                self.probed = True
                if _check.changed(before, q, k, v):
                    return self._caught(_check.WROTE_AT_FULL_SIZE)
            else:
                result = self.run_sparse(q, k, v, scale, kind.knob)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails falls back, as every kernel does
            if _guard.is_sticky(exc):
                raise
            return self._caught(f"failed at run time: {failure_text(exc)}")
        if self._non_finite(result.out, q, k, v, scale):
            return self._caught(_guard.NON_FINITE)
        return result

    def _probe(self, knob, q, k, v, scale) -> str:
        part = _check.probe(q, k, v, None, self.spec.layout)
        self.run_sparse(*part.args[:3], scale, knob)
        return "" if part.untouched() else _check.WROTE_INPUTS

    def _non_finite(self, out, q, k, v, scale) -> bool:
        if q.device.type in _guard.DEFERRED:
            if self.late is None:
                self.late = _guard.LateCount(q.device)
            return bool(self.late.add(out, q, k, v))
        return _guard.non_finite_blame(out, q, k, v, None, scale, self.spec.layout)

    def _caught(self, what: str):
        self.reason = f"{self.backend} {what}"
        log.warning("sparse attention: %s %s on %s; the signature runs dense from now on", self.backend, what,
                    _guard.spec_text(self.spec))
        stats.count("guard", (self.spec.role, self.backend, what, "dense", True), 1, _scope.current().recordings)
        for key in [key for key in _kinds if key[0] == self.identity]:
            _kinds[key] = Kind(reason=self.reason)
        return None


def _adapted(backend, layout: str, cast):
    """``run_sparse`` taking the call's layout and dtype, returning its output in them."""
    transpose = layout != backend.layout

    def run(q, k, v, scale, knob):
        dtype = q.dtype
        if transpose:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cast is not None:
            q, k, v = (t.to(cast) for t in (q, k, v))
        result = backend.run_sparse(q, k, v, scale, knob)
        out = result.out.transpose(1, 2) if transpose else result.out
        result.out = out.to(dtype) if cast is not None else out
        return result

    return run

