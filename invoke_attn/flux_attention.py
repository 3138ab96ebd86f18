"""A stand-in for InvokeAI's FLUX.1 ``attention(q, k, v, pe, attn_mask=None)``
(``invokeai.backend.flux.math``), which its FLUX blocks import by name.

InvokeAI's function applies the rotary embedding with its own ``apply_rope``, runs SDPA on
(batch, heads, tokens, head_dim) and returns (batch, tokens, heads × head_dim). The stand-in does the
same with the engine in place of SDPA, calling that module's ``apply_rope`` so that the rotary
arithmetic stays InvokeAI's; a call made while no routed node runs goes to the original as made.
"""
from __future__ import annotations

import sys

import lib_attn


def make(original, role):
    """The stand-in for ``original`` (InvokeAI's function), serving calls for ``role()``."""
    math_module = sys.modules[original.__module__]

    def attention(q, k, v, pe, attn_mask=None):
        call_role = role()
        if call_role is None:
            return original(q, k, v, pe, attn_mask=attn_mask)
        q, k = math_module.apply_rope(q, k, pe)
        out = lib_attn.attention(q, k, v, mask=attn_mask, role=call_role)
        batch, heads, tokens, head_dim = out.shape
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)

    attention.__wrapped__ = original
    attention.__qualname__ = f"served {original.__module__}.{original.__qualname__}"
    return attention
