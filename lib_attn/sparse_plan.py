"""What runs a call signature while sparse attention is on: a ``Plan``, which the dispatcher's decision
for the signature carries, and which sends each call to the sparse backend or to the dense chain.

* **Eligible or not** (``dense_reason``), once per signature and position: sparse takes denoiser
  self-attention without a mask and with at least ``min_tokens`` queries, outside the dense windows,
  on a sparse backend that takes it. Every other call runs the dense chain (the tuned dense decision
  the configuration makes for it), counted under its reason.
* **Per call kind** (``Kind``: the signature, the model the call comes from, the block, the band of
  steps, ``BANDS`` of them, which model call of the step it is: CFG's cond and uncond passes, run
  as two model calls, attend differently, and the conditioning tokens the host told: their blocks are
  always kept), the sparsest setting within the budget. The model is the
  ``torch.nn.Module`` whose code made the call (``caller_module``) with its weights as they are
  (``model_token``): another model, or the same one with other weights loaded, is calibrated anew, and a
  module's kinds go with it. A kind is calibrated at its first call: the backend's ladder is measured on
  rows drawn for the call (``measure.draw``) against an exact reference (``measure.routed_errors``: every
  setting from one set of exact scores, for a backend that states its routing; else a run of the kernel
  per setting, from the sparsest, until one is within the budget). A kind no setting brings within the
  budget runs dense, counted as ``over budget: 0.23 > 0.15`` (the error of the densest setting tried).
  After that, one call in each run of ``RECHECK_EVERY`` of the kind's calls, drawn at random, has its
  output measured (``measure.output_error``) on newly drawn rows; one over the budget is not returned:
  the kind is calibrated again on that call, whose output is the new setting's (or dense).
* **Faults** are caught as for every kernel: the first sparse call of a plan runs on copies of a part
  of the call first (``check.probe``), and its full-size run is bracketed by checksums; every sparse
  output is screened for non-finite values (on CUDA through the guard's device-side count, read
  later). A backend caught is out for the signature, counted in the guard's table, and the call is
  recomputed dense.

The counts go to ``stats`` (``sparse``, ``sparse_dense``, ``sparse_error`` for measured outputs returned,
``sparse_replaced`` for those recomputed, ``sparse_kept``, ``sparse_seconds``), in the process and in the
recordings open where the call runs.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import check as _check
from . import conditioning
from . import guard as _guard
from . import schedule as _schedule
from . import scope as _scope
from . import sparse_measure as measure
from . import stats
from .decision import verdict
from .kernels import REGISTRY, SPARSE_IDS, status
from .kernels.base import failure_text
from .spec import NO_MASK

log = logging.getLogger("lib_attn")

#: The steps of a pass fall in this many bands, each a call kind of its own (attention concentrates
#: differently early and late in sampling).
BANDS = 5
#: A kind that runs sparse has one call in each run of this many measured, drawn at random.
RECHECK_EVERY = 4
DENOISER = ("unet", "dit")
OVER_BUDGET = "over budget"
#: A call whose error could not be measured (exact attention on the sampled rows was not finite): it runs
#: dense and its kind keeps no setting, so the next call of the kind measures again.
NOT_MEASURED = "not measured: non-finite values"
#: A call whose sparse run ran out of memory: it runs dense; the kind and the signature stay.
OUT_OF_MEMORY = "out of memory in the sparse kernel (this call)"
#: A call of a kind another thread is calibrating: it runs dense.
CALIBRATING = "kind being calibrated in another thread"
#: The part of the time (``sparse_seconds``) of the calls that calibrated a kind, its first or after a
#: measurement over the budget (compiling a kernel for a new shape falls there too).
CALIBRATION = "calibration"


def band_of(progress) -> int | None:
    return None if progress is None else min(int(progress * BANDS), BANDS - 1)


def band_text(band) -> str:
    return "" if band is None else f"{band * 100 // BANDS}-{(band + 1) * 100 // BANDS}%"


def kind_label(block, band, call=None, text=None) -> str:
    """A call kind as the readout names it: ``block 3, 20-40%``; ``any`` when neither is known; a step's
    later model calls (CFG's second pass) add ``call 2 of the step``, a joint call whose conditioning
    tokens the host told (``lib_attn.conditioning``) ``512 text tokens first``."""
    parts = ([f"block {block}"] if block is not None else []) + ([band_text(band)] if band is not None else [])
    if call:
        parts.append(f"call {call + 1} of the step")
    if text is not None:
        parts.append(text.text)
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

#: Which calls and rows are measured is drawn from this generator, seeded from the operating system in
#: each process (again in a forked child); ``seed`` fixes it.
_random = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_random.seed)
#: Guards the kinds and the models (several threads may run calls).
_lock = threading.RLock()


def seed(value) -> None:
    """Fix which calls and rows are measured from now on (a process seeds it from the OS)."""
    _random.seed(value)


@dataclass
class Kind:
    """A call kind's state: ``knob`` the setting it runs at (None: dense, for ``reason``); ``rungs``
    what is left of its ladder, denser settings first to last; ``owner`` the thread calibrating it, or
    None; ``calls`` its calls in the current run of ``RECHECK_EVERY``, of which the ``pick``-th is
    measured; ``due``: its next call is measured whatever the draw."""

    knob: object = None
    reason: str = ""
    rungs: tuple = ()
    owner: object = None
    calls: int = 0
    pick: int = field(default_factory=lambda: _random.randrange(RECHECK_EVERY))
    due: bool = False

    def measured_now(self) -> bool:
        """Whether this call of the kind is measured: one call in each run of ``RECHECK_EVERY`` calls,
        drawn at random, so no period of the run (blocks, CFG passes, steps) lines up with the draw,
        and no more than ``2 * RECHECK_EVERY - 2`` calls pass unmeasured in a row."""
        with _lock:
            hit = self.due or self.calls == self.pick
            self.due = False
            self.calls += 1
            if self.calls == RECHECK_EVERY:
                self.calls, self.pick = 0, _random.randrange(RECHECK_EVERY)
            return hit


#: (plan identity, model, block, band, model call of the step) -> Kind; kept across the dispatcher's decisions (a webui
#: re-applies its settings every generation), dropped by ``forget`` and with their model.
_kinds: dict = {}

# -- the model a call comes from ---------------------------------------------------------------------

#: Frames looked through, from the engine's own outwards, for the ``torch.nn.Module`` a call comes from.
CALLER_FRAMES = 12
#: The engine's own folder (``lib_attn/``): its frames are never the caller.
_ENGINE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: module -> [model token, its weights' (parameter id, version)]: a module whose weights are replaced or
#: loaded again (a checkpoint switch, a LoRA) gets a new token, as does a new module.
_models: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokens = itertools.count(1)
#: Tokens of modules gone or reloaded, whose kinds are dropped at the next new kind.
_gone: list = []


def caller_module():
    """The ``torch.nn.Module`` whose code made the current call (the nearest ``self`` that is one, outside
    the engine), or None (a call from a script's own function)."""
    frame = sys._getframe(1)
    for _ in range(CALLER_FRAMES):
        if frame is None:
            return None
        if not frame.f_code.co_filename.startswith(_ENGINE) and "self" in frame.f_code.co_varnames:
            found = frame.f_locals.get("self")
            if isinstance(found, torch.nn.Module):
                return found
        frame = frame.f_back
    return None


def model_token(module) -> int | None:
    """The token of ``module`` as it is now (its weights included), or None without one."""
    if module is None:
        return None
    weights = _weights(next(module.parameters(), None))
    with _lock:
        known = _models.get(module)
        if known is not None and known[1] == weights:
            return known[0]
        token = next(_tokens)
        if known is None:
            known = _models[module] = [token, weights]
            weakref.finalize(module, _gone_with, known)
        else:  # the same module with other weights: another model
            _gone.append(known[0])
            known[0], known[1] = token, weights
        return token


def _weights(first):
    """What tells a module's weights apart: its first parameter and that tensor's version counter. An
    inference tensor has no counter (ComfyUI loads and runs models under ``torch.inference_mode``): the
    tensor and its storage then, which a weight replaced (ComfyUI's patching of a LoRA, a reload) changes."""
    if first is None:
        return None
    if first.is_inference():
        return (id(first), first.data_ptr())
    return (id(first), first._version)


def _gone_with(known: list) -> None:
    _gone.append(known[0])


def _claim(key) -> tuple[Kind, bool]:
    """The kind under ``key`` and whether this call made it (then this thread calibrates it)."""
    with _lock:
        kind = _kinds.get(key)
        if kind is not None:
            return kind, False
        if _gone:
            dead = set(_gone)
            _gone.clear()
            for old in [old for old in _kinds if old[1] in dead]:
                del _kinds[old]
        kind = _kinds[key] = Kind(owner=threading.get_ident())
        return kind, True


def forget() -> None:
    with _lock:
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
        """(output, the part of the time it counts under: ``sparse``, ``dense`` or ``calibration``)."""
        here = _scope.current().where
        block, band, call = here.block, band_of(here.progress), here.call
        text = conditioning.current(self.spec.q_len)  # the backend reads it too: its routing keeps them
        key = (self.identity, model_token(caller_module()), block, band, call, text)
        kind, fresh = _claim(key)
        label = kind_label(block, band, call, text)
        unknown = unknown_windows(self.windows, here, self.spec) if self.windows else ()
        if unknown:
            label = f"{label}; {unknown_text(unknown)}"
        try:
            return self._measured_call(key, kind, fresh, label, q, k, v, scale, recordings)
        except _OutOfMemory:
            return self._dense(OUT_OF_MEMORY, q, k, v, None, scale, recordings), "dense"

    def _measured_call(self, key, kind: Kind, fresh: bool, label: str, q, k, v, scale, recordings):
        if fresh:
            return self._settle(key, kind, label, q, k, v, scale, recordings), CALIBRATION
        if kind.owner is not None and kind.owner != threading.get_ident():
            return self._dense(CALIBRATING, q, k, v, None, scale, recordings), "dense"
        if kind.knob is None:
            return self._dense(kind.reason, q, k, v, None, scale, recordings), "dense"
        out = self._sparse(kind, q, k, v, scale)
        if out is None:  # a fault: the plan is dense from now on
            return self._dense(self.reason, q, k, v, None, scale, recordings), "dense"
        if kind.measured_now():
            error = measure.output_error(out.out, q, k, v, scale, self.spec.layout,
                                         measure.draw(q, self.spec.layout, _random))
            if math.isnan(error):  # nothing measured: this call runs dense and the next one is measured
                kind.due = True
                return self._dense(NOT_MEASURED, q, k, v, None, scale, recordings), "dense"
            if not error <= self.budget:  # recomputed at the setting this call's inputs need
                self._replaced(label, kind.knob, error, recordings)
                kind.owner = threading.get_ident()
                return self._settle(key, kind, label, q, k, v, scale, recordings), CALIBRATION
            self._record(label, kind.knob, error, out, recordings)
        return self._returned(label, kind, out.out, recordings), "sparse"

    def _returned(self, label: str, kind: Kind, out, recordings):
        stats.count("sparse", (self.spec.role, self.backend, label, kind.knob.text), 1, recordings)
        stats.count("calls", (self.spec.role, self.backend, self.spec.rule), 1, recordings)
        return out

    def _settle(self, key, kind: Kind, label: str, q, k, v, scale, recordings):
        """Calibrate ``kind`` on this call (its first, or one whose measurement was over the budget) and
        return the call's output: sparse at the setting found, measured within the budget, else dense."""
        try:
            samples = measure.draw(q, self.spec.layout, _random, measure.CALIBRATION_ROWS)
            kind.knob, kind.reason, kind.rungs, kind.due = None, "", (), False
            out, error = self._calibrate(kind, q, k, v, scale, samples)
            if kind.reason == NOT_MEASURED:
                return self._unsettled(key, q, k, v, scale, recordings)
            if kind.knob is None:
                return self._dense(kind.reason, q, k, v, None, scale, recordings)
            if out is None:
                out = self._sparse(kind, q, k, v, scale)
                if out is None:  # a fault: the plan is dense from now on
                    return self._dense(self.reason, q, k, v, None, scale, recordings)
                error = measure.output_error(out.out, q, k, v, scale, self.spec.layout, samples)
            if math.isnan(error):
                return self._unsettled(key, q, k, v, scale, recordings)
            if not error <= self.budget:
                self._replaced(label, kind.knob, error, recordings)
                self._denser(kind, error)
                stats.count("sparse_dense", (self.spec.role, over_budget(error, self.budget)), 1, recordings)
                return self.dense(q, k, v, None, scale)
            self._record(label, kind.knob, error, out, recordings)
            return self._returned(label, kind, out.out, recordings)
        except _OutOfMemory:  # calibration did not finish: the kind's next call calibrates
            with _lock:
                if _kinds.get(key) is kind:
                    del _kinds[key]
            return self._dense(OUT_OF_MEMORY, q, k, v, None, scale, recordings)
        finally:
            kind.owner = None

    def _unsettled(self, key, q, k, v, scale, recordings):
        """A call whose error could not be measured: dense, and its kind's next call calibrates."""
        with _lock:
            _kinds.pop(key, None)
        return self._dense(NOT_MEASURED, q, k, v, None, scale, recordings)

    # -- calibration --------------------------------------------------------------------------------

    def _ladder(self) -> tuple:
        knob = self.settings.knob
        return self.kernel.ladder(knob) if self.settings.calibrate else (knob,)

    def _calibrate(self, kind: Kind, q, k, v, scale, samples):
        """Put ``kind`` at the sparsest setting of the ladder within the budget on ``samples`` (or dense);
        returns the call's sparse result and its error on ``samples`` when calibration ran the kernel at
        that setting, else (None, None)."""
        ladder = self._ladder()
        errors = None
        if self.kernel.states_routing:  # its ``routing`` may still give none for this call: then it is run
            errors = measure.routed_errors(q, k, v, scale, self.spec.layout, self._pair_routings(ladder, q, k, scale),
                                           samples, bound=True)
        if errors is not None:
            for i, error in enumerate(errors):
                if math.isnan(error):
                    kind.reason = NOT_MEASURED
                    return None, None
                if error <= self.budget:
                    kind.knob, kind.rungs = ladder[i], ladder[i + 1:]
                    return None, None
            kind.reason = over_budget(errors[-1], self.budget)
            return None, None
        error = math.inf
        for i, knob in enumerate(ladder):
            kind.knob = knob
            result = self._sparse(kind, q, k, v, scale)
            if result is None:
                kind.knob, kind.reason = None, self.reason
                return None, None
            measured, error = measure.output_errors(result.out, q, k, v, scale, self.spec.layout, samples)
            if math.isnan(error):
                kind.knob, kind.reason = None, NOT_MEASURED
                return None, None
            if error <= self.budget:
                kind.rungs = ladder[i + 1:]
                return result, measured
        kind.knob, kind.reason = None, over_budget(error, self.budget)
        return None, None

    def _pair_routings(self, ladder, q, k, scale):
        """A function of a (batch item, head) pair giving each setting's routing of that pair alone: the
        routings of a whole call hold an index per kept block for every pair and setting (404 MiB at Wan
        2.1's 720p call with CFG batched, 80 pairs, seven settings), of which calibration reads the pairs
        it drew."""
        heads = 2 if self.spec.layout == "bshd" else 1

        def of(b: int, h: int):
            return self._routings(ladder, *(t[b:b + 1].narrow(heads, h, 1) for t in (q, k)), scale)
        return of

    def _routings(self, ladder, q, k, scale):
        """Each setting's routing (q, k as the kernel sees them), or None when the backend states none."""
        if not self.kernel.states_routing:
            return None
        qb, kb = (t.transpose(1, 2) if self.spec.layout == "bshd" else t for t in (q, k))
        if self.cast is not None:
            qb, kb = qb.to(self.cast), kb.to(self.cast)
        return self.kernel.routings(qb, kb, scale, ladder)

    def _denser(self, kind: Kind, error: float) -> None:
        if kind.rungs:
            kind.knob, kind.rungs = kind.rungs[0], kind.rungs[1:]
        else:
            kind.knob, kind.reason = None, over_budget(error, self.budget)

    def _record(self, label: str, knob, error: float, result, recordings) -> None:
        """A measured output that was returned: its error and the share of blocks it computed."""
        role = self.spec.role
        shown = round(error, 4) if math.isfinite(error) else error
        stats.count("sparse_error", (role, self.backend, label, knob.text, shown), 1, recordings)
        try:
            share = result.share()
        except Exception as exc:  # noqa: BLE001 - out of memory for the share: the call's output stands
            if not _is_oom(exc):
                raise
            share = math.nan
        if math.isfinite(share):
            stats.count("sparse_kept", (role, self.backend, label, knob.text), share, recordings)

    def _replaced(self, label: str, knob, error: float, recordings) -> None:
        """A measured output over the budget, not returned (recomputed): counted apart with its error."""
        shown = round(error, 4) if math.isfinite(error) else error
        stats.count("sparse_replaced", (self.spec.role, self.backend, label, knob.text, shown), 1, recordings)

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
            if _is_oom(exc):
                raise _OutOfMemory() from exc
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
        with _lock:
            for key in [key for key in _kinds if key[0] == self.identity]:
                _kinds[key] = Kind(reason=self.reason)
        return None


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


class _OutOfMemory(Exception):
    """A sparse run that ran out of memory: that call runs dense, the kind and the signature stay."""


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

