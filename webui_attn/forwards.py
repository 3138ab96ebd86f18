"""The forwards and attention functions both hosts install; each routes attention through ``lib_attn``.

Nothing here is chosen at patch time: every call asks the engine, so a backend change between
generations needs no re-patching. Host modules are imported inside the A1111 forwards, at call time,
because the webui's ``modules`` package is only there when a webui runs.
"""
from __future__ import annotations

import torch

import lib_attn

from . import flags


def _upcast(tensors, upcast: bool):
    if upcast and tensors[0].dtype != torch.float32:
        return tuple(t.float() for t in tensors)
    return tensors


def heads_attention(q, k, v, heads: int, mask=None, *, role: str, upcast: bool = False,
                    skip_reshape: bool = False):
    """Multi-head attention in the webuis' convention; returns ``(b, n, heads*d)`` in q's dtype.

    q: ``(b, n, heads*d)``, k/v: ``(b, m, heads*d)``; with ``skip_reshape`` all three are already
    ``(b, heads, n|m, d)`` (Forge's Flux passes strided views). ``mask`` is bool (True attends) or additive,
    shaped ``(n, m)``, ``(b|1, n, m)`` or ``(b|1, heads|1, n, m)``. ``upcast`` runs the attention in fp32.
    """
    dtype = q.dtype
    b = q.shape[0]
    if skip_reshape:
        layout = "bhsd"
    else:
        layout = "bshd"
        d = q.shape[-1] // heads
        q, k, v = (t.unflatten(-1, (heads, d)) for t in (q, k, v))
    q, k, v = _upcast((q, k, v), upcast)
    if mask is not None and mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (b, n, m) has no heads axis: it applies to every head
    out = lib_attn.attention(q, k, v, layout=layout, mask=mask, role=role, fp32=flags.fp32_for_upcast(upcast))
    if skip_reshape:
        out = out.transpose(1, 2)
    return out.reshape(b, out.shape[1], -1).to(dtype)


def spatial_attention(q, k, v, *, upcast: bool = False):
    """The VAE's single-head attention over pixels: ``(B, C, H, W)`` x3 -> ``(B, C, H, W)``, head dim C."""
    dtype = q.dtype
    B, C, H, W = q.shape
    q, k, v = (t.reshape(B, 1, C, H * W).transpose(2, 3) for t in (q, k, v))
    q, k, v = _upcast((q, k, v), upcast)
    out = lib_attn.attention(q, k, v, layout="bhsd", role="vae", fp32=flags.fp32_for_upcast(upcast))
    return out.transpose(2, 3).reshape(B, C, H, W).to(dtype)


# --- A1111: class-level forwards for ldm/sgm CrossAttention and AttnBlock --------------------------------

def cross_attention_forward(self, x, context=None, mask=None, **kwargs):
    """``CrossAttention.forward`` for ldm and sgm, doing what A1111's built-in ``sdp`` forward does.

    ``**kwargs`` absorbs sgm's ``additional_tokens`` and ``n_times_crossframe_attn_in_self``, which the
    built-ins ignore too. ``mask`` keeps ldm's meaning, a ``(b, ...)`` bool mask over the context tokens.
    """
    from modules import shared
    from modules.hypernetworks import hypernetwork

    q = self.to_q(x)
    context = x if context is None else context
    context_k, context_v = hypernetwork.apply_hypernetworks(shared.loaded_hypernetworks, context)
    k = self.to_k(context_k)
    v = self.to_v(context_v)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], -1)[:, None, None, :]
    upcast = bool(getattr(shared.opts, "upcast_attn", False))
    out = heads_attention(q, k, v, self.heads, mask, role="unet", upcast=upcast)
    return self.to_out(out)


def attnblock_forward(self, x, **kwargs):
    """``AttnBlock.forward`` (ldm, sgm) and ldm's ``MemoryEfficientAttnBlock.forward``: norm, q/k/v 1x1
    convs, single-head attention over pixels, ``proj_out``, residual. ``**kwargs`` matches sgm's signature.
    """
    from modules import shared

    h = self.norm(x)
    out = spatial_attention(self.q(h), self.k(h), self.v(h), upcast=bool(getattr(shared.opts, "upcast_attn", False)))
    return x + self.proj_out(out)


# --- Forge (and A1111's SD3): module-level attention functions -----------------------------------------

def make_heads_function(role: str, precision=None):
    """An attention function with Forge's signature ``(q, k, v, heads, mask=None, attn_precision=None,
    skip_reshape=False) -> (b, n, heads*d)`` that calls the engine with ``role``.

    ``precision(attn_precision)`` resolves the host's precision rules (Forge: ``get_attn_precision``);
    a result of ``torch.float32`` makes the call run in fp32. None: the inputs' dtype is kept.
    The same function serves A1111's SD3 ``attention(q, k, v, heads, mask=None)``.
    """
    def attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
        wanted = precision(attn_precision) if precision is not None else attn_precision
        return heads_attention(q, k, v, heads, mask, role=role, upcast=wanted == torch.float32,
                               skip_reshape=skip_reshape)

    attention_function.__qualname__ = attention_function.__name__ = f"lib_attn_{role}_attention"
    return attention_function


def make_spatial_function(precision=None):
    """Forge's VAE function ``(q, k, v) -> (B, C, H, W)`` through the engine (role ``vae``)."""
    def attention_function_single_head_spatial(q, k, v):
        wanted = precision(None) if precision is not None else None
        return spatial_attention(q, k, v, upcast=wanted == torch.float32)

    attention_function_single_head_spatial.__qualname__ = "lib_attn_vae_attention"
    return attention_function_single_head_spatial
