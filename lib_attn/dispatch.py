"""The dispatcher: the engine's entry, ``attention``, deciding once per call signature.

The decision path flows one way: ``spec`` (what a call is) -> ``kernels`` (each backend's reasons)
-> ``check`` and ``tune`` (checking and ranking by measurement) -> ``guard`` (watching outputs) ->
``chains`` (which backends are tried, in order) -> ``decision`` (the backend that takes a call) ->
``graph_op`` (the operator a traced call becomes) -> this module, which uses them all and is used
by none of them.

``attention`` caches the decision under the call's metadata, so the hot path does a dict lookup,
one countdown, one counter increment and the kernel call: no probing and no reason strings. The
countdown tells when the output guard (``guard``) looks at a call: a decision's first call, then a
sample of its calls (every call of an approximate kernel); a kernel whose output fails loses the
signature and the call is recomputed on the next backend, as is a call whose kernel raises.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from . import _compat
from . import check as _check
from . import config as _config
from . import graph_op
from . import guard as _guard
from . import schedule as _schedule
from . import scope as _scope
from . import stats
from . import tune as _tune
from . import tuning_file
from .chains import chain_for, tuning_chain
from .decision import Decision, decide, decide_tuned, trusted, wrap
from .kernels import BACKEND_IDS, REGISTRY, not_in_chains
from .kernels.base import failure_text, is_sticky
from . import sparse_plan as _sparse_plan
from .spec import CallSpec, spec_of, validate

log = logging.getLogger("lib_attn")


class AttentionFallbackError(RuntimeError):
    """Raised in strict mode when a call would not run on the backend the configuration put first."""


# --- the hot path -----------------------------------------------------------------------------

#: Decisions by call signature (``_key``), which holds the token of the configuration in force.
_cache: dict = {}
_failed: dict = {}  # signature key -> {backend id: failure text}
_reported: set = set()


def _forget() -> None:
    _cache.clear()


_config.on_change(_forget)


_grad_enabled = torch.is_grad_enabled
_compiling = _compat.IS_COMPILING
_scope_get = _scope.get
_GLOBAL = _scope.GLOBAL


def _key(q, k, v, mask, layout, role, backend, fp32, exact=False):
    """Everything a decision depends on, read from metadata only. Strides are not in it (every
    backend takes strided views); k's and v's devices are read as their index, which is cheaper and,
    with q's full device, tells a mixed call from a valid one. The schedule's token (None without a
    schedule) says which of its rules hold where sampling is in the scope in force, and the
    configuration's token which configuration is in force there. ``attention`` inlines the same
    tuple: keep the two in step."""
    scope = _scope.current()
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
            mask if mask is None else (mask.shape, mask.dtype, mask.get_device()),
            _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                 or (mask is not None and mask.requires_grad)),
            (scope.config or _GLOBAL.config).token, scope.where.token, exact, layout, role, backend, fp32)


def _scheduled(cfg, spec: CallSpec):
    """(configuration, spec) for a call under the schedule in force: the first rule that takes the call
    puts its chain in force for the call's role, and the spec says which rule served it."""
    if cfg.schedule is None:
        return cfg, spec
    rule = _schedule.rule_for(cfg.schedule, _scope.current().where.token, spec.role, spec.q_len, spec.kv_len)
    spec = replace(spec, rule=(cfg.schedule.text, rule.label if rule is not None else _schedule.OTHERWISE))
    return _with_rule(cfg, spec.role, rule), spec


def _for_rule(cfg, spec: CallSpec):
    """The configuration in force for a call the schedule's rule ``spec.rule`` served."""
    rule = cfg.schedule.rule(spec.rule[1]) if spec.rule is not None and cfg.schedule is not None else None
    return _with_rule(cfg, spec.role, rule)


def _with_rule(cfg, role: str, rule):
    """``cfg`` with ``rule``'s chain for ``role`` (the configuration itself when no rule applies)."""
    return cfg if rule is None else replace(cfg, preference={**cfg.preference, role: rule.chain})


def _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, measure=True, exact=False) -> Decision:
    """Validate a call and decide for it; ``key`` is its signature (None when it has none).
    ``measure``: tuning may run kernels on this call's inputs (not for ``explain``)."""
    validate(q, k, v, mask, layout, role, scale)
    if backend is not None and backend not in BACKEND_IDS:
        raise ValueError(not_in_chains([backend]) or f"unknown backend id {backend!r}; valid ids: "
                                                         f"{', '.join(BACKEND_IDS)}")
    if fp32 is not None and fp32 not in _config.FP32_POLICIES:
        raise ValueError(f"fp32 policy {fp32!r} is not one of {', '.join(_config.FP32_POLICIES)}")
    cfg, spec = _scheduled(_config.current(), spec_of(q, k, v, mask, layout, role, exact))
    if cfg.sparse is not None and measure and key is not None and key[0] != _DENSE:
        return _sparse_decision(q, k, v, mask, scale, key, cfg, spec)
    chain, explicit = chain_for(role, spec.device, backend, cfg, spec)
    fp32 = fp32 or cfg.fp32
    excluded = _guarded_out(spec, fp32, cfg)
    pool = tuning_chain(role, spec.device, backend, cfg, spec)
    if pool:
        if _tune.blocked(spec.device.type):
            # Tracing, capture or backward: the fixed order serves this call, and is not cached, so
            # that the signature's first ordinary call still tunes.
            dec = decide(spec, chain, fp32=fp32, explicit=explicit, failed=_failed.get(key), excluded=excluded)
            dec.final = False
            return dec
        inputs = (q, k, v, mask, scale) if measure and key is not None else None
        dec = decide_tuned(spec, chain, pool, fp32, explicit, _failed.get(key), inputs, excluded)
        if dec is not None:
            return dec
    return decide(spec, chain, fp32=fp32, explicit=explicit, failed=_failed.get(key), excluded=excluded)


#: The first item of the key under which a sparse plan's dense calls keep their own decision.
_DENSE = "dense"


def _sparse_decision(q, k, v, mask, scale, key, cfg, spec: CallSpec) -> Decision:
    """The decision of a signature while sparse attention is on: its ``plan`` serves every call (sparse,
    or dense with its reason, see ``lib_attn.sparse_plan``); the dense calls run the decision the
    configuration makes for them without sparse, under ``(_DENSE,) + key``."""
    layout, role, backend, fp32 = key[-4:]
    dense_key = (_DENSE,) + key
    inner = _dense_decision(dense_key, q, k, v, mask, scale)
    reason, sparse_id, cast = _sparse_plan.dense_reason(cfg, spec, _scope.current().where.token, fp32 or cfg.fp32)
    if backend is not None and not reason:
        reason = f"backend {backend} named for the call"
    bare = replace(spec, tensors=None)

    def dense(q, k, v, mask, scale):
        found = _dense_decision(dense_key, q, k, v, mask, scale)
        if found.fallback_cell is not None:
            _on_fallback(found)
        return _call(dense_key, found, q, k, v, mask, scale)

    plan = _sparse_plan.Plan(cfg, bare, reason, None if reason else sparse_id, cast, dense)
    plan.dense_key = dense_key
    rejected = [(cfg.sparse.method, [reason])] if reason else []
    return Decision(sparse_id if not reason else inner.backend, rejected, spec=bare, source=inner.source,
                    countdown=0, plan=plan)


def _dense_decision(dense_key, q, k, v, mask, scale) -> Decision:
    found = _cache.get(dense_key)
    if found is None:
        layout, role, backend, fp32 = dense_key[-4:]
        found = _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, dense_key, exact=dense_key[-5])
        if found.final:
            _cache[dense_key] = found
    return found


def _guarded_out(spec: CallSpec, fp32: str, cfg) -> dict | None:
    """The backends whose output failed its check on this signature on this machine, with the reason
    (none while the guard is off): they do not get the signature."""
    if cfg.guard == "off":
        return None
    return {bid: reason for bid, reason in tuning_file.rejections(spec, fp32).items() if bid != "math"} or None


def explain(q, k, v, *, layout="bhsd", mask=None, scale=None, role="unet", backend=None, fp32=None,
            exact=False) -> Decision:
    """The decision ``attention`` would take for this call, without running a kernel.

    After the signature's first call this is the cached decision. Before it, with tuning on, it is
    the stored ranking when the tuning file has one, else the fixed order (``source == "order"``).
    """
    try:
        key = _key(q, k, v, mask, layout, role, backend, fp32, exact)
        found = _cache.get(key)
    except (AttributeError, TypeError, IndexError, RuntimeError):
        key = found = None
    return found or _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, measure=False, exact=exact)


def attention(q, k, v, *, layout="bhsd", mask=None, scale=None, role="unet", backend=None, fp32=None, exact=False):
    """Attention over q, k, v on the fastest backend that takes the call, falling back per call.

    q: (b, h, q_len, d), k and v: (b, h, kv_len, d) in layout ``"bhsd"``; (b, seq, h, d) in ``"bshd"``.
    Strided views are fine. ``mask`` follows F.scaled_dot_product_attention (bool: True takes part;
    float: added to the scores), broadcastable to (b, h, q_len, kv_len). ``scale`` defaults to
    1/sqrt(d). ``role`` (unet, dit, vae, text) selects the chain; ``backend`` puts one id first for
    this call; ``fp32`` ("cast"/"keep") overrides the fp32 policy for this call; ``exact`` keeps the
    call off every ``approximate`` backend (each passed over with that reason).
    Returns (b, h, q_len, d) or (b, q_len, h, d) as the input, in q's dtype.

    Under torch.compile the call is one opaque operator (``traced``), decided when it runs.
    """
    if _compiling():
        return traced(q, k, v, mask, layout, scale, role, backend, fp32, exact)
    scope = _scope_get() or _GLOBAL
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
               mask if mask is None else (mask.shape, mask.dtype, mask.get_device()),
               _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                 or (mask is not None and mask.requires_grad)),
               (scope.config or _GLOBAL.config).token, scope.where.token, exact, layout, role, backend, fp32)
        dec = _cache[key]
    except KeyError:
        dec = _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, exact=exact)
        if dec.final:
            _cache[key] = dec
    except (AttributeError, TypeError, RuntimeError):  # not tensors (or an unhashable argument)
        key = None
        dec = _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, exact=exact)
    if dec.fallback_cell is not None:
        _on_fallback(dec)
    dec.countdown -= 1
    if dec.countdown < 0:
        return _guarded(key, dec, q, k, v, mask, scale)
    try:
        out = dec.run(q, k, v, mask, scale)
    except Exception as exc:  # noqa: BLE001 - sorted by _recover: only recoverable kinds fall back
        return _recover(key, dec, exc, q, k, v, mask, scale)
    dec.call_cell.n += 1
    for counts in scope.calls:
        counts[dec.count_key] += 1
    return out


def _count_call(dec: Decision) -> None:
    """``attention``'s count of a call that ran (which it inlines), for the other ways a call ends."""
    dec.call_cell.n += 1
    for counts in _scope.current().calls:
        counts[dec.count_key] += 1


def _count_fallback(dec: Decision) -> None:
    """A call of ``dec`` ran on another backend than the one put first: its fallback and its path."""
    dec.fallback_cell.n += 1
    dec.path_cell.n += 1
    for rec in _scope.current().recordings:
        rec.here["fallbacks"][dec.fallback_key] += 1
        rec.here["paths"][dec.path_key] += 1


def _call(key, dec: Decision, q, k, v, mask, scale):
    """``attention``'s work after the decision (which it inlines): the guard when it is due, else the kernel."""
    dec.countdown -= 1
    if dec.countdown < 0:
        return _guarded(key, dec, q, k, v, mask, scale)
    return _run(key, dec, q, k, v, mask, scale)


def _run(key, dec: Decision, q, k, v, mask, scale):
    """The kernel and the count; a failure goes to ``_recover``."""
    try:
        out = dec.run(q, k, v, mask, scale)
    except Exception as exc:  # noqa: BLE001 - as in attention
        return _recover(key, dec, exc, q, k, v, mask, scale)
    _count_call(dec)
    return out


def _guarded(key, dec: Decision, q, k, v, mask, scale):
    """A call the guard looks at (see ``guard``): checked against the reference when it is the
    decision's first (or the mode is ``full``), else screened for non-finite values."""
    device = dec.spec.device.type
    if dec.plan is not None:  # sparse attention is on: the plan serves the call (it checks what it runs)
        dec.countdown = 0
        if _tune.blocked(device):  # tracing, capture, backward: nothing may be read or measured
            return dec.plan.dense(q, k, v, mask, scale)
        return dec.plan(q, k, v, mask, scale)
    mode = _config.current().guard
    backend = REGISTRY[dec.backend]
    if _tune.blocked(device):  # tracing, capture, backward: nothing may be read; the next call is looked at
        dec.countdown = 0
        return _run(key, dec, q, k, v, mask, scale)
    late = 0
    try:
        if not dec.checked or mode == "full":
            out, reason = _guard.first_check(dec.run, q, k, v, mask, scale, dec.spec.layout,
                                             dec.cast or dec.spec.dtype, backend.approximate, probe=not dec.checked)
        else:
            out = dec.run(q, k, v, mask, scale)
            reason = _check.shape_mismatch(out, q.shape)
            if not reason and mode == "on" and device in _guard.DEFERRED:
                if dec.late is None:
                    dec.late = _guard.LateCount(q.device)
                late = dec.late.add(out, q, k, v)
                reason = f"{_check.CHECK_FAILED}: {_guard.NON_FINITE}" if late else ""
            elif not reason and _guard.non_finite_blame(out, q, k, v, mask, scale, dec.spec.layout):
                reason = f"{_check.CHECK_FAILED}: {_guard.NON_FINITE}"
    except Exception as exc:  # noqa: BLE001 - as in attention
        return _recover(key, dec, exc, q, k, v, mask, scale)
    if reason.startswith(_guard.UNCHECKED):
        # No memory to check it: this call runs as it is, and the decision's next call is checked.
        _unchecked_once(dec, reason)
        dec.countdown = 0
        _count_call(dec)
        return out
    if not reason:
        if not dec.checked:
            trusted.add((dec.backend, dec.spec))
        dec.checked = True
        dec.countdown = _guard.countdown(mode, dec.backend, backend.approximate, True)
        _count_call(dec)
        return out
    del out
    return _caught(key, dec, reason, late, q, k, v, mask, scale)


def _unchecked_once(dec: Decision, reason: str) -> None:
    if (dec.backend, dec.spec) not in _reported:
        _reported.add((dec.backend, dec.spec))
        log.warning("attention guard: %s could not be checked on %s, %s; that call ran unchecked, the next one "
                    "is checked", dec.backend, _guard.spec_text(dec.spec), reason)


def _caught(key, dec: Decision, reason: str, late: int, q, k, v, mask, scale):
    """The guard caught ``dec.backend``'s output: the backend loses the signature (here and in the
    tuning file) and the call is recomputed on the next backend. ``late``: earlier calls found
    faulty after they had returned (CUDA, mode on), which nothing can recompute."""
    spec = dec.spec
    cfg = _for_rule(_config.current(), spec)
    short = _guard.short(reason)
    # A fault found while watching a trusted kernel, or its rejection before it was trusted.
    text = short if dec.checked and short == _guard.NON_FINITE else f"rejected for {_guard.spec_text(spec)}: {short}"
    if cfg.strict:
        raise AttentionFallbackError(f"strict mode: guard: {dec.backend} {text}; it would be recomputed on the next "
                                     "backend")
    layout, role, backend, fp32 = key[-4:] if key is not None else (spec.layout, spec.role, None, None)
    fp32 = fp32 or cfg.fp32
    tuning_file.reject(spec, fp32, dec.backend, reason)
    trusted.discard((dec.backend, spec))
    for other, cached in list(_cache.items()):  # every cached decision of this kernel for this signature
        if cached.backend == dec.backend and cached.spec == spec:
            _cache.pop(other, None)
    chain, explicit = chain_for(role, spec.device, backend, cfg, spec)
    new = decide(replace(spec_of(q, k, v, mask, layout, role, spec.exact), rule=spec.rule), chain, fp32=fp32, explicit=explicit,
                 failed=_failed.get(key), excluded=_guarded_out(spec, fp32, cfg))
    if key is not None:
        _cache[key] = new
    if _check.THROUGH_AUTOGRAD in reason:
        # Recomputing would hand back an output whose gradients go through the kernel's write.
        raise RuntimeError(f"attention guard: {dec.backend} {text}; it is rejected from now on (also in the "
                           f"tuning file), and this step cannot be recomputed: run it again")
    log.warning("attention guard: %s %s; recomputed on %s%s", dec.backend, text, new.backend,
                f" ({late} earlier call(s) found faulty after they had returned)" if late else "")
    stats.count("guard", (role, dec.backend, text, new.backend, not late), late or 1, _scope.current().recordings)
    if new.fallback_cell is not None:
        _count_fallback(new)
        _report_once(new.fallback_key, new.backend)
    return _call(key, new, q, k, v, mask, scale)


#: What a call traced by torch.compile becomes: the ``lib_attn::attention`` operator, which runs
#: ``attention`` when the compiled graph runs.
traced = graph_op.operator(attention)


def _on_fallback(dec: Decision) -> None:
    if _config.current().strict:
        role, preferred, reasons = dec.fallback_key
        raise AttentionFallbackError(
            f"strict mode: {preferred} cannot take this {role} call ({dec.spec.describe()}): {reasons}; "
            f"it would run on {dec.backend}")
    _count_fallback(dec)
    _report_once(dec.fallback_key, dec.backend)


def _report_once(fallback_key: tuple, ran_on: str) -> None:
    role, preferred, reasons = fallback_key
    if (preferred, reasons) not in _reported:
        _reported.add((preferred, reasons))
        log.warning("attention: %s passed over for %s calls (%s); running %s instead", preferred, role, reasons, ran_on)


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def _recover(key, dec: Decision, exc: Exception, q, k, v, mask, scale):
    """A kernel failed: demote it for this signature and rerun on the next backend, or re-raise."""
    # Bad input that shares a cached signature with good input (the key reads k's and v's device
    # index, not their full device) must surface as the ValueError it is, never demote a backend.
    validate(q, k, v, mask, dec.spec.layout, dec.spec.role, scale)
    if _is_oom(exc):
        # The VAE's single 512-wide head is the one call whose memory grows with the image: retry it
        # on the bounded path. Elsewhere an OOM is the host's to handle, as without this extension.
        if dec.spec.role != "vae" or dec.backend == "math":
            raise exc
        fallback_key = (dec.spec.role, dec.backend, "out of memory")
        if _config.current().strict:
            raise AttentionFallbackError(f"strict mode: {dec.backend} ran out of memory on a vae call") from exc
        recordings = _scope.current().recordings
        stats.count("fallbacks", fallback_key, 1, recordings)
        stats.count("paths", (fallback_key, (), "math"), 1, recordings)
        _report_once(fallback_key, "math")
        out = wrap(REGISTRY["math"].run, dec.spec.layout != "bhsd", None)(q, k, v, mask, scale)
        stats.count("calls", (dec.spec.role, "math", dec.spec.rule), 1, recordings)
        return out
    sticky = is_sticky(exc)
    recoverable = isinstance(exc, (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError))
    if sticky or not recoverable or dec.backend == "math" or key is None:
        raise exc
    text = failure_text(exc)
    if _config.current().strict:
        raise AttentionFallbackError(f"strict mode: {dec.backend} failed on {dec.spec.describe()}: {text}") from exc
    failed = _failed.setdefault(key, {})
    failed[dec.backend] = text
    cfg = _for_rule(_config.current(), dec.spec)
    layout, role, backend, fp32 = key[-4:]
    chain, explicit = chain_for(role, dec.spec.device, backend, cfg, dec.spec)
    # A fresh spec carries this call's tensors, so PyTorch's own checks speak for the next backend.
    new = decide(replace(spec_of(q, k, v, mask, layout, role, dec.spec.exact), rule=dec.spec.rule), chain, fp32=fp32 or cfg.fp32,
                 explicit=explicit, failed=failed, excluded=_guarded_out(dec.spec, fp32 or cfg.fp32, cfg))
    _cache[key] = new
    if new.fallback_cell is not None:
        _count_fallback(new)
        _report_once(new.fallback_key, new.backend)
    return _call(key, new, q, k, v, mask, scale)  # the next backend may fail too: same rules


def reset() -> None:
    """Forget decisions, demotions, tuned marks and the once-only log record (tests)."""
    _cache.clear()
    _failed.clear()
    trusted.clear()
    _reported.clear()
    stats.forget_tuned()
    _sparse_plan.forget()
