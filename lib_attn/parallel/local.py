"""One rank's share of a ring step: attention over a chunk of keys that also returns the log-sum-exp.

A ring merges partial outputs by their log-sum-exp (LSE), so its local kernel must return one. The
kernel is the engine's choice for the call, made as for any call (chain, tuning, schedule, guard): the
decision is the dispatcher's own, cached under the same signature. When the chosen backend can
return the LSE, its LSE form runs; when it cannot, the same chain is walked again without the backends
that cannot, and the call is counted as a fallback with that reason.

Which backends return the LSE, and how:

* ``flash-attn``: FA2's ``flash_attn_func(..., return_attn_probs=True)`` gives (out, lse, ...); FA3's
  ``flash_attn_func`` gives (out, lse) from 2.6.2 to 2.8.1 (later ones: ``return_attn_probs=True``).
* ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``: PyTorch's aten operators return it (the CPU flash
  kernel's operator too); ``sdpa`` uses the operator of the kernel PyTorch would choose for the call.
* ``math``: the engine's own chunked path, here with its LSE (computed in fp32, fp64 for fp64 inputs).
* ``sdpa-math``, ``xformers``, SageAttention, FlashAttention-4 and added backends: none here.

An LSE is not trusted before it is checked: the first call of each signature on each backend (every
call with guard ``full``; none with guard ``off``) is compared on sampled query rows with a float64
reference of both the output and the LSE. An all-zero or otherwise wrong LSE is a guard failure:
counted as such, the backend loses the signature for ring steps, and the step is recomputed.
"""
from __future__ import annotations

import logging
import math as _math
from dataclasses import replace

import torch

from .. import _compat
from .. import dispatch as _dispatch
from .. import scope as _scope
from .. import stats
from ..chains import chain_for
from ..config import current as _current_config
from ..config import on_change
from ..check import bound
from ..decision import decide
from ..kernels import REGISTRY
from ..kernels.base import default_scale, last_dim_contiguous
from .. import sparse_plan as _sparse_plan
from ..spec import spec_of

log = logging.getLogger("lib_attn")

NO_LSE = "returns no log-sum-exp (needed by ring steps)"
#: Query rows the LSE check compares with its float64 reference (of one batch item, two heads).
CHECK_ROWS = 32

#: Ring steps of a signature that a backend whose LSE form raised sits out before it is tried again
#: (an out-of-memory passes; a rank must not stay on a slower kernel, holding back every rank of its
#: ring, for the rest of the process). Doubled at each failure after, up to ``RETRY_MOST``: a kernel
#: that always fails costs one more try every so often, no more.
RETRY_AFTER = 64
RETRY_MOST = 4096

_plans: dict = {}      # dispatcher signature -> (decision that runs, LSE runner, fallback key or None,
#                        the signature's sitting-out backends or None)
_bad_lse: dict = {}    # dispatcher signature -> {backend id: why its LSE form failed the check there}
_failed: dict = {}     # dispatcher signature -> {backend id: [why it raised, ring steps left]}
_bounds: dict = {}     # (dispatcher signature, backend id) -> the steps it sat out last
_checked: set = set()  # (backend id, spec) whose LSE passed


def _forget() -> None:
    _plans.clear()


on_change(_forget)


#: Bytes of scores one chunk of ``math_lse`` holds (its one buffer). The dense path's 16 MiB would cut a
#: Wan 720p ring block (40 heads x 37,800 keys) to one query row per chunk: 37,800 Python iterations a
#: step; at 256 MiB it is 44 rows, 860 iterations.
LSE_CHUNK_BYTES = 256 * 2**20


def math_lse(q, k, v, scale):
    """Attention and its LSE in plain PyTorch, a block of query rows at a time (bounded memory): one
    score buffer per block, the softmax taken in place, the output written into its place."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, n, d = q.shape
    kt = k.to(compute).transpose(-1, -2)
    vc = v.to(compute)
    out = q.new_empty((b, h, n, v.shape[-1]))
    lse = torch.empty((b, h, n), dtype=compute, device=q.device)
    row_bytes = b * h * k.shape[2] * torch.finfo(compute).bits // 8
    rows = max(1, min(n, LSE_CHUNK_BYTES // max(1, row_bytes)))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        scores = torch.matmul(q[:, :, start:stop].to(compute), kt).mul_(scale)
        top = scores.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(compute).min)  # no inf - inf
        total = scores.sub_(top).exp_().sum(dim=-1, keepdim=True)
        out[:, :, start:stop] = torch.matmul(scores, vc).div_(total)
        lse[:, :, start:stop] = (top + total.log()).squeeze(-1)
    return out, lse


def _sdpa_flash(q, k, v, scale):
    if q.device.type == "cpu" and _compat.CPU_FLASH_OP is not None:  # torch 2.1: the generic operator below
        out, lse = _compat.CPU_FLASH_OP(q, k, v, 0.0, False, scale=scale)[:2]
        return out, lse
    q, k, v = last_dim_contiguous(q, k, v)
    out, lse = _compat.FLASH_OP(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse


def _sdpa_efficient(q, k, v, scale):
    q, k, v = last_dim_contiguous(q, k, v)
    args = (None,) if _compat.EFFICIENT_OP_TAKES_BIAS else ()
    out, lse = _compat.EFFICIENT_OP(q, k, v, *args, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # some releases pad the LSE's rows to a multiple of 32


def _sdpa_cudnn(q, k, v, scale):
    q, k, v = last_dim_contiguous(q, k, v)
    if _compat.CUDNN_OP_TAKES_BIAS:
        out, lse = _compat.CUDNN_OP(q, k, v, None, True, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = _compat.CUDNN_OP(q, k, v, True, 0.0, False, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])  # (b, h, s, 1) in some releases


def _flash_attn(q, k, v, scale):
    backend = REGISTRY["flash-attn"]
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # flash-attn's (b, s, h, d)
    fa3 = getattr(backend, "fa3", None)
    if fa3 is not None and backend.variant(spec_of(q, k, v, None, "bhsd", "dit")) == "FA3":
        got = fa3.flash_attn_func(qs, ks, vs, softmax_scale=scale)
        if not isinstance(got, tuple):
            got = fa3.flash_attn_func(qs, ks, vs, softmax_scale=scale, return_attn_probs=True)
    else:
        got = backend.fa2.flash_attn_func(qs, ks, vs, dropout_p=0.0, softmax_scale=scale, causal=False,
                                          return_attn_probs=True)
    return got[0].transpose(1, 2), got[1]


def _sdpa(q, k, v, scale):
    """``sdpa``: the LSE form of the kernel PyTorch would run for this call."""
    choice = _compat.FUSED_SDP_CHOICE(q, k, v) if _compat.FUSED_SDP_CHOICE is not None else None
    for name, run in (("FLASH_ATTENTION", _sdpa_flash), ("EFFICIENT_ATTENTION", _sdpa_efficient),
                      ("CUDNN_ATTENTION", _sdpa_cudnn)):
        if choice is not None and choice == _compat.SDP_BACKEND.get(name):
            return run(q, k, v, scale)
    raise NotImplementedError("PyTorch would run its math kernel, which returns no log-sum-exp")


RUNNERS = {"math": math_lse, "sdpa-flash": _sdpa_flash, "sdpa-efficient": _sdpa_efficient,
           "sdpa-cudnn": _sdpa_cudnn, "flash-attn": _flash_attn, "sdpa": _sdpa}


def can_return_lse(backend_id: str) -> bool:
    return backend_id in RUNNERS


def attention_lse(q, k, v, scale, role: str, step: bool = True):
    """(out, lse) for q, k, v in (b, h, s, d): out in q's dtype, lse (b, h, q_len) in fp32 (fp64 for
    fp64 inputs), on the kernel the engine chooses for the call. ``step``: False for a step recomputed
    after its backend failed (it does not count as one of the steps that backend sits out)."""
    key = _dispatch._key(q, k, v, None, "bhsd", role, None, None)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(key, q, k, v, scale, role)
    if step and plan[3] is not None and _sat_out(plan[3]):
        _plans.pop(key, None)
        plan = _plan(key, q, k, v, scale, role)
    dec, run, fallback_key, _ = plan
    if fallback_key is not None:
        stats.count("fallbacks", fallback_key, 1, _scope.current().recordings)
    try:
        out, lse = _cast_run(run, dec.cast, q, k, v, scale)
        if dec.backend != "math" and _needs_check(dec):
            reason = lse_check(out, lse, q, k, v, scale, dec.cast or q.dtype)
            if reason:
                return _rejected(key, dec, reason, q, k, v, scale, role)
            _checked.add((dec.backend, dec.spec))
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        if dec.backend == "math":
            raise
        bound = min(RETRY_MOST, 2 * _bounds[key, dec.backend]) if (key, dec.backend) in _bounds else RETRY_AFTER
        _bounds[key, dec.backend] = bound
        why = f"failed at run time: {type(exc).__name__}: {str(exc).strip()[:200]}"
        _failed.setdefault(key, {})[dec.backend] = [f"{why}; tried again after {bound} ring steps", bound]
        return _rejected(key, dec, why, q, k, v, scale, role, transient=True)
    _dispatch._count_call(dec)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _cast_run(run, cast, q, k, v, scale):
    if cast is None:
        return run(q, k, v, scale)
    out, lse = run(q.to(cast), k.to(cast), v.to(cast), scale)
    return out.to(q.dtype), lse


def _needs_check(dec) -> bool:
    mode = _current_config().guard
    return mode == "full" or (mode == "on" and (dec.backend, dec.spec) not in _checked)


def _plan(key, q, k, v, scale, role: str):
    """The engine's decision for the call, or, when its backend cannot return the LSE (or its LSE
    failed the check on this signature), the chain's next one that can."""
    dec = _dispatch._cache.get(key)
    if dec is None:
        dec = _dispatch._decide_call(q, k, v, None, "bhsd", role, None, None, scale, key)
        if dec.final:
            _dispatch._cache[key] = dec
    sparse = dec.plan
    if sparse is not None:  # sparse attention is on: a ring step runs the call's dense decision
        dec = _dispatch._dense_decision(sparse.dense_key, q, k, v, None, scale)
    failed = _failed.get(key) or None
    bad = {**_bad_lse.get(key, {}), **{bid: entry[0] for bid, entry in (failed or {}).items()}}
    why = NO_LSE if not can_return_lse(dec.backend) else bad.get(dec.backend)
    plan = (dec, RUNNERS.get(dec.backend), None, failed)
    if sparse is not None and sparse.backend is not None and not why:
        # say so for ring: the dense decision serves, counted as a fallback from the sparse backend
        reason = _sparse_plan.ring_reason(sparse.kernel, dec.spec)
        plan = (dec, RUNNERS[dec.backend], (sparse.spec.role, sparse.backend, reason), failed)
    if why:
        cfg = _dispatch._for_rule(_current_config(), dec.spec)
        chain, explicit = chain_for(role, dec.spec.device, None, cfg, dec.spec)
        excluded = {bid: NO_LSE for bid in chain if not can_return_lse(bid)}
        excluded.update(bad)
        excluded.pop("math", None)  # the reference itself: always there, never rejected
        spec = replace(spec_of(q, k, v, None, "bhsd", role), rule=dec.spec.rule)
        ring_dec = decide(spec, chain + ("math",), fp32=cfg.fp32, explicit=explicit, excluded=excluded)
        fallback_key = (role, dec.backend, why)
        if (dec.backend, why) not in _dispatch._reported:
            _dispatch._reported.add((dec.backend, why))
            log.warning("attention: %s passed over for ring steps of %s calls (%s); running %s instead",
                        dec.backend, role, why, ring_dec.backend)
        plan = (ring_dec, RUNNERS[ring_dec.backend], fallback_key, failed)
    if dec.final:
        _plans[key] = plan
    return plan


def _sat_out(failed: dict) -> bool:
    """One ring step of a signature with backends sitting out: True when one of them is due again (it
    has sat out all its steps: this is the one after)."""
    due = False
    for bid in list(failed):
        failed[bid][1] -= 1
        if failed[bid][1] < 0:
            del failed[bid]
            due = True
    return due


def _rejected(key, dec, reason: str, q, k, v, scale, role: str, transient: bool = False):
    """The LSE form of ``dec.backend`` failed on this signature: count it, plan again, recompute.
    ``transient``: it raised (it sits out ``_failed``'s steps), else its result failed the check
    (it loses the signature for ring steps)."""
    if not transient:
        _bad_lse.setdefault(key, {})[dec.backend] = reason
    _plans.pop(key, None)
    _checked.discard((dec.backend, dec.spec))
    stats.count("guard", (role, dec.backend, f"ring step: {reason}", "next backend", True), 1,
                _scope.current().recordings)
    log.warning("attention guard: %s rejected for ring steps: %s", dec.backend, reason)
    if _current_config().strict:
        raise _dispatch.AttentionFallbackError(f"strict mode: {dec.backend} rejected for ring steps: {reason}")
    return attention_lse(q, k, v, scale, role, step=False)


def lse_check(out, lse, q, k, v, scale, dtype) -> str:
    """'' when ``out`` and ``lse`` agree with a float64 reference on sampled query rows, else why not."""
    n = q.shape[2]
    if tuple(lse.shape) != tuple(q.shape[:3]):
        return f"log-sum-exp has shape {tuple(lse.shape)}, expected {tuple(q.shape[:3])}"
    rows = torch.linspace(0, n - 1, min(n, CHECK_ROWS), device=q.device).round().long().unique()
    # The first batch item and the first and last heads: a float64 copy of every key would cost as much
    # memory as the call (Wan's 720p block: 1.5 GB), and a wrong LSE is wrong on every head.
    heads = sorted({0, q.shape[1] - 1})
    q, k, v, out, lse = (t[:1, heads] for t in (q, k, v, out, lse))
    scores = torch.matmul(q[:, :, rows].double(), k.double().transpose(-1, -2)) * default_scale(scale, q.shape[-1])
    ref_lse = torch.logsumexp(scores, dim=-1)
    ref_out = torch.matmul(torch.softmax(scores, dim=-1), v.double())
    got_lse = lse[:, :, rows].double()
    limit = bound(dtype, q.device.type, False)
    if not torch.isfinite(got_lse).all():
        return "log-sum-exp has non-finite values"
    if bool((got_lse == 0).all()) and bool((ref_lse.abs() > limit).any()):
        return "log-sum-exp is all zero"
    # The LSE is a log: its error is absolute, the size of the scores' relative error.
    lse_err = float((got_lse - ref_lse).abs().max())
    if lse_err > limit * max(1.0, float(ref_lse.abs().max())):
        return f"log-sum-exp off by {lse_err:.3g} (bound {limit:g} for {dtype})"
    got = out[:, :, rows].double()
    err = float(torch.linalg.vector_norm(got - ref_out) / max(float(torch.linalg.vector_norm(ref_out)), 1e-30))
    if not _math.isfinite(err) or err > limit:
        return f"output off by {err:.3g} relative (bound {limit:g} for {dtype})"
    return ""


def reset() -> None:
    _plans.clear()
    _bad_lse.clear()
    _failed.clear()
    _bounds.clear()
    _checked.clear()
