"""Double of Forge's backend/attention.py (host-contract B2): the attention functions, Forge's precision
rule, and the one-time selection of ``attention_function`` / ``attention_function_single_head_spatial``.

Multi-head functions take ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False)``:
q/k/v ``(b, n, heads*d)``, or ``(b, heads, n, d)`` with ``skip_reshape``; they return ``(b, n, heads*d)``.
The split and sub-quadratic functions chunk the same math in Forge; here they compute it unchunked.
"""
import torch

from backend import memory_management
from backend.args import args

FORCE_UPCAST_ATTENTION_DTYPE = memory_management.force_upcast_attention_dtype()


def get_attn_precision(attn_precision=torch.float32):
    if args.disable_attention_upcast:
        return None
    if FORCE_UPCAST_ATTENTION_DTYPE is not None:
        return FORCE_UPCAST_ATTENTION_DTYPE
    return attn_precision


def _to_bhnd(q, k, v, heads, skip_reshape):
    if skip_reshape:
        return q, k, v
    b, _, inner = q.shape
    d = inner // heads
    return tuple(t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))


def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    """Softmax(QK^T * d^-0.5 [+ mask]) V in plain torch; fp32 scores when the precision rule says so.

    An additive mask is ``(n, m)``, ``(b|1, n, m)`` or ``(b|1, h, n, m)``; a bool mask is ``(b, ...)`` over
    the keys (True attends), unlike ``attention_pytorch``, which hands any mask to SDPA as it is.
    """
    attn_precision = get_attn_precision(attn_precision)
    dtype = q.dtype
    q, k, v = _to_bhnd(q, k, v, heads, skip_reshape)
    b, h, _, d = q.shape
    if attn_precision == torch.float32:
        sim = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) * d ** -0.5
    else:
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * d ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            # Forge reads a bool mask the ldm way: per batch item, over the keys, for every head and query
            keys = mask.reshape(mask.shape[0], -1)[:, None, None, :]
            sim = sim.masked_fill(~keys, -torch.finfo(sim.dtype).max)
        else:
            sim = sim + _heads_mask(mask).to(sim.dtype)
    sim = sim.softmax(dim=-1)
    out = torch.einsum("bhij,bhjd->bhid", sim.to(v.dtype), v)
    return out.transpose(1, 2).reshape(b, -1, h * d).to(dtype)


def _heads_mask(mask):
    """(n, m) / (b, n, m) / (b, h, n, m) -> broadcastable to (b, h, n, m)."""
    if mask.dim() == 3:
        return mask.unsqueeze(1)
    return mask


def attention_sub_quad(query, key, value, heads, mask=None, attn_precision=None, skip_reshape=False):
    return attention_basic(query, key, value, heads, mask, attn_precision, skip_reshape)


def attention_split(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    return attention_basic(q, k, v, heads, mask, attn_precision, skip_reshape)


def attention_xformers(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    import xformers.ops  # selected only when memory_management.xformers_enabled()
    q, k, v = _to_bhnd(q, k, v, heads, skip_reshape)
    b, h, _, d = q.shape
    out = xformers.ops.memory_efficient_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=mask)
    return out.reshape(b, -1, h * d)


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    """SDPA; ignores ``attn_precision``, passes ``mask`` to SDPA as given."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def slice_attention_single_head_spatial(q, k, v):
    """q (b, hw, c), k (b, c, hw), v (b, c, hw) -> (b, c, hw)."""
    scale = int(q.shape[-1]) ** (-0.5)
    s = torch.bmm(q, k) * scale
    s = torch.nn.functional.softmax(s, dim=2).permute(0, 2, 1)
    return torch.bmm(v, s)


def normal_attention_single_head_spatial(q, k, v):
    b, c, h, w = q.shape
    q = q.reshape(b, c, h * w).permute(0, 2, 1)
    k = k.reshape(b, c, h * w)
    v = v.reshape(b, c, h * w)
    return slice_attention_single_head_spatial(q, k, v).reshape(b, c, h, w)


def xformers_attention_single_head_spatial(q, k, v):
    import xformers.ops
    B, C, H, W = q.shape
    q, k, v = (t.view(B, C, -1).transpose(1, 2).contiguous() for t in (q, k, v))
    out = xformers.ops.memory_efficient_attention(q, k, v, attn_bias=None)
    return out.transpose(1, 2).reshape(B, C, H, W)


def pytorch_attention_single_head_spatial(q, k, v):
    """(B, C, H, W) -> (B, C, H, W) with SDPA on a (B, 1, HW, C) view: head dim C."""
    B, C, H, W = q.shape
    q, k, v = (t.view(B, 1, C, -1).transpose(2, 3).contiguous() for t in (q, k, v))
    try:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = out.transpose(2, 3).reshape(B, C, H, W)
    except memory_management.OOM_EXCEPTION:
        out = slice_attention_single_head_spatial(q.view(B, -1, C), k.view(B, -1, C).transpose(1, 2),
                                                  v.view(B, -1, C).transpose(1, 2)).reshape(B, C, H, W)
    return out


if memory_management.xformers_enabled():
    attention_function = attention_xformers
elif memory_management.pytorch_attention_enabled():
    attention_function = attention_pytorch
elif args.attention_split:
    attention_function = attention_split
else:
    attention_function = attention_sub_quad

if memory_management.xformers_enabled_vae():
    attention_function_single_head_spatial = xformers_attention_single_head_spatial
elif memory_management.pytorch_attention_enabled():
    attention_function_single_head_spatial = pytorch_attention_single_head_spatial
else:
    attention_function_single_head_spatial = normal_attention_single_head_spatial


class AttentionProcessorForge:
    """Forge's diffusers attention processor (its Spaces and geowizard): diffusers' ``Attention`` module's
    projections around ``attention_function``, looked up in this module at call time."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args,
                 **kwargs):
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        hidden_states = attention_function(query, key, value, heads=attn.heads, mask=attention_mask)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor
