"""Attention functions in the hosts' function convention, served by the engine.

Forge, its lines and ComfyUI call attention as a function of ``(q, k, v, heads, ...)``; the VAE as a
function of three ``(B, C, H, W)`` maps. The functions made here take the widest form of that call,
ComfyUI's::

    fn(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)

so one adapter serves every host: Forge's narrower calls fit it. Of the keywords ComfyUI's functions
are given, ``scale`` (the scores' factor, 1/sqrt(d) when None) and ``enable_gqa`` (keys and values with
fewer heads than the queries, each serving a group of consecutive query heads, as PyTorch's SDPA reads
it) are honoured; ``low_precision_attention=False`` (calls whose model breaks under 8-bit attention,
which ComfyUI's SageAttention function sends to PyTorch's) runs the call on an exact kernel; ComfyUI's
bookkeeping (``transformer_options``, ``_inside_attn_wrapper``) carries nothing for the call. Any other
keyword is refused (``TypeError`` naming it), never dropped: ``unknown_keywords`` lets a host hand such
a call to its own function first.
Every call asks the engine, so a backend change between generations needs no re-patching.
"""
from __future__ import annotations

import inspect

import torch

import lib_attn
from lib_attn.kernels.base import failure_text

from . import voice


#: Keywords of the hosts' attention calls that carry nothing for the call's result.
BOOKKEEPING = frozenset(("transformer_options", "_inside_attn_wrapper"))
#: Keywords the engine's functions act on.
HONOURED = frozenset(("scale", "enable_gqa", "low_precision_attention"))
#: Keywords a call may pass that need no look: the function's own parameters (``heads`` too: Wan's and other
#: ComfyUI model files pass it by name, which ``wrap_attn`` hands an override among the keywords) and the bookkeeping.
ORDINARY = BOOKKEEPING | frozenset(("heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape"))


def unknown_keywords(kwargs) -> list[str]:
    """The keywords of a call that the engine's functions can neither honour nor leave out."""
    return sorted(name for name in kwargs if name not in ORDINARY and name not in HONOURED)


def refuse_unknown(kwargs) -> None:
    unknown = unknown_keywords(kwargs)
    if unknown:
        raise TypeError(f"attention keyword {', '.join(map(repr, unknown))} is not taken by this extension's engine "
                        f"(it takes {', '.join(sorted(HONOURED))})")


def parameters(fn) -> dict:
    """A function's parameters by name (empty for something that is not introspectable)."""
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def keep_fp32(upcast: bool) -> str | None:
    """The per-call fp32 policy when the host asks for fp32 attention and nothing else says: ``keep``
    (a host whose user can choose a policy passes its own rule)."""
    return "keep" if upcast else None


def _upcast(tensors, upcast: bool):
    if upcast and tensors[0].dtype != torch.float32:
        return tuple(t.float() for t in tensors)
    return tensors


def heads_attention(q, k, v, heads: int, mask=None, *, role: str, upcast: bool = False,
                    skip_reshape: bool = False, skip_output_reshape: bool = False, fp32_rule=keep_fp32,
                    exact: bool = False, scale=None, enable_gqa: bool = False):
    """Multi-head attention in the hosts' convention, in q's dtype.

    q: ``(b, n, heads*d)``, k/v: ``(b, m, heads*d)`` (or ``(b, m, heads, d)``); with ``skip_reshape`` all three are already
    ``(b, heads, n|m, d)`` (strided views are fine: Flux passes them). ``mask`` is bool (True attends)
    or additive, shaped ``(n, m)``, ``(b|1, n, m)`` or ``(b|1, heads|1, n, m)``, as PyTorch's SDPA reads
    it. Returns ``(b, n, heads*d)``, or ``(b, heads, n, d)`` with ``skip_output_reshape``.
    ``upcast`` runs the attention in fp32; ``fp32_rule(upcast)`` gives the per-call fp32 policy then.
    ``exact`` keeps the call off approximate kernels. ``scale`` multiplies the scores (1/sqrt(d) when
    None); ``enable_gqa`` lets k and v have fewer heads than q, a divisor of ``heads`` (then, without
    ``skip_reshape``, their last axis holds their own heads of d channels each).
    """
    dtype = q.dtype
    b = q.shape[0]
    if skip_reshape:
        layout = "bhsd"
    else:
        layout = "bshd"
        d = q.shape[-1] // heads
        kv_heads = -1 if enable_gqa else heads
        # As ComfyUI views each input as (b, -1, heads, d): Wan Animate passes keys of (b, m, heads, d).
        q = q.unflatten(-1, (heads, d)) if q.dim() == 3 else q.reshape(b, -1, heads, d)
        k, v = (t.unflatten(-1, (kv_heads, d)) if t.dim() == 3 else t.reshape(t.shape[0], -1, kv_heads, d)
                for t in (k, v))
    if enable_gqa:
        k, v = _grouped(q, k, v, 1 if skip_reshape else 2)
    q, k, v = _upcast((q, k, v), upcast)
    if mask is not None and mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (b, n, m) has no heads axis: it applies to every head
    out = lib_attn.attention(q, k, v, layout=layout, mask=mask, scale=scale, role=role, fp32=fp32_rule(upcast),
                             exact=exact)
    if skip_output_reshape:
        out = out if skip_reshape else out.transpose(1, 2)
        return out.to(dtype)
    if skip_reshape:
        out = out.transpose(1, 2)
    return out.reshape(b, out.shape[1], -1).to(dtype)


def _grouped(q, k, v, axis: int):
    """k and v with each of their heads repeated for its group of query heads (PyTorch's SDPA's
    ``enable_gqa``: key head j serves query heads j*g … j*g+g-1)."""
    heads, kv_heads = q.shape[axis], k.shape[axis]
    if kv_heads == heads:
        return k, v
    if kv_heads != v.shape[axis] or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"enable_gqa=True: the query heads ({heads}) must be a multiple of the key and value heads "
                         f"({kv_heads}, {v.shape[axis]})")
    group = heads // kv_heads
    return k.repeat_interleave(group, dim=axis), v.repeat_interleave(group, dim=axis)


def spatial_attention(q, k, v, *, upcast: bool = False, fp32_rule=keep_fp32):
    """The VAE's single-head attention over pixels: ``(B, C, H, W)`` x3 -> ``(B, C, H, W)``, head dim C
    (any number of spatial axes after C: a video VAE's blocks pass what they have)."""
    dtype, shape = q.dtype, q.shape
    B, C = shape[:2]
    q, k, v = (t.reshape(B, 1, C, -1).transpose(2, 3) for t in (q, k, v))
    q, k, v = _upcast((q, k, v), upcast)
    out = lib_attn.attention(q, k, v, layout="bhsd", role="vae", fp32=fp32_rule(upcast))
    return out.transpose(2, 3).reshape(shape).to(dtype)


class PrecisionRule:
    """A host's ``get_attn_precision``, called as that host defines it: Forge's takes the requested
    precision, Forge Neo's and reForge's also the inputs' dtype. A rule that raises (Forge Neo's
    2025-10 rule reads a flag its parser does not define) is not called again: the requested precision
    is used, and that is said once. Without a rule the requested precision is used as it is."""

    def __init__(self, rule=None, host_name: str = "the host"):
        self.rule = rule
        self.host_name = host_name
        names = list(parameters(rule)) if rule is not None else []
        self.takes_dtype = len(names) >= 2
        self.failed: str | None = None

    def __call__(self, requested, dtype):
        if self.rule is None or self.failed is not None:
            return requested
        try:
            return self.rule(requested, dtype) if self.takes_dtype else self.rule(requested)
        except Exception as exc:  # noqa: BLE001 - the host's own defect must not fail a generation
            self.failed = failure_text(exc)
            voice.log_once(("precision-rule", self.host_name, self.failed),
                           f"{self.host_name}'s get_attn_precision failed ({self.failed}); attention runs at the "
                           f"precision each call asks for")
            return requested


def make_heads_function(role: str, precision: PrecisionRule | None = None, fp32_rule=keep_fp32, exact: bool = False):
    """An attention function of ComfyUI's form (see the module docstring) that calls the engine with
    ``role``. ``precision(attn_precision, dtype)`` resolves the host's precision rule; a result of
    ``torch.float32`` makes the call run in fp32, None keeps the inputs' dtype. The same function
    serves Forge's narrower form and A1111's SD3 ``attention(q, k, v, heads, mask=None)``.
    ``fp32_rule``: see ``heads_attention``. ``exact``: every call runs on an exact kernel (calls the
    host keeps off approximate kernels); otherwise those that pass ``low_precision_attention=False``.
    """
    def attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
        refuse_unknown(kwargs)
        wanted = precision(attn_precision, q.dtype) if precision is not None else attn_precision
        return heads_attention(q, k, v, heads, mask, role=role, upcast=wanted == torch.float32,
                               skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, fp32_rule=fp32_rule,
                               exact=exact or kwargs.get("low_precision_attention", True) is False,
                               scale=kwargs.get("scale"), enable_gqa=bool(kwargs.get("enable_gqa", False)))

    name = f"lib_attn_{role}_exact_attention" if exact else f"lib_attn_{role}_attention"
    attention_function.__qualname__ = attention_function.__name__ = name
    return attention_function


def make_spatial_function(precision: PrecisionRule | None = None, fp32_rule=keep_fp32):
    """The VAE's function ``(q, k, v) -> (B, C, H, W)`` through the engine (role ``vae``)."""
    def attention_function_single_head_spatial(q, k, v):
        wanted = precision(None, q.dtype) if precision is not None else None
        return spatial_attention(q, k, v, upcast=wanted == torch.float32, fp32_rule=fp32_rule)

    attention_function_single_head_spatial.__qualname__ = "lib_attn_vae_attention"
    return attention_function_single_head_spatial
