"""Double of Forge Neo's backend/attention.py.

Every multi-head function has ComfyUI's form ``(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)``: q/k/v ``(b, n, heads*d)``, or
``(b, heads, n, d)`` with ``skip_reshape``; the result is ``(b, n, heads*d)``, or ``(b, heads, n, d)``
with ``skip_output_reshape``. Unknown keyword arguments (``transformer_options``) are accepted.

``get_attn_precision(attn_precision, current_dtype)`` reads ``args.dont_upcast_attention`` first,
which Neo's parser never defines: it raises AttributeError, and so do ``attention_basic`` and
``attention_split``, which call it (Neo's defect, kept). SDPA and xformers ignore the precision.
The choice is made once, at import: sage > flash > xformers > pytorch > split > basic.
"""
import torch

from backend import memory_management
from backend.args import args

FORCE_UPCAST_ATTENTION_DTYPE = memory_management.force_upcast_attention_dtype()

#: SageAttention 2 (the installed version starts with "2"), known only where Neo uses sage; only then
#: does ``--sage2-function`` pick a kernel of it instead of ``sageattn``.
IS_SAGE_2 = False
if memory_management.sage_enabled():
    import importlib.metadata
    IS_SAGE_2 = importlib.metadata.version("sageattention").startswith("2")


def get_attn_precision(attn_precision, current_dtype):
    if args.dont_upcast_attention:
        return None
    if FORCE_UPCAST_ATTENTION_DTYPE is not None:
        return FORCE_UPCAST_ATTENTION_DTYPE.get(current_dtype, attn_precision)
    return attn_precision


def _split_heads(q, k, v, heads, skip_reshape):
    """(b, heads, n, d) views of the inputs, and d."""
    if skip_reshape:
        return q, k, v, q.shape[-1]
    b, _, inner = q.shape
    d = inner // heads
    return (*(t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v)), d)


def _merge(out, skip_output_reshape):
    """(b, heads, n, d) -> the form the caller asked for."""
    if skip_output_reshape:
        return out
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def _sdpa_mask(mask):
    """Neo hands SDPA a mask with batch and heads axes: (n, m) -> (1, n, m) -> (1, 1, n, m)."""
    if mask is not None and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """Softmax(q kᵀ d^-0.5 [+ mask]) v in plain torch. A bool mask is read per batch item over the
    keys (the ldm way); an additive one is (n, m), (b|1, n, m) or with a heads axis."""
    attn_precision = get_attn_precision(attn_precision, q.dtype)
    q, k, v, d = _split_heads(q, k, v, heads, skip_reshape)
    b, h = q.shape[:2]
    if attn_precision == torch.float32:
        sim = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) * d ** -0.5
    else:
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * d ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            keys = mask.reshape(mask.shape[0], -1)[:, None, None, :]
            sim = sim.masked_fill(~keys, -torch.finfo(sim.dtype).max)
        else:
            bs = 1 if mask.ndim == 2 else mask.shape[0]
            sim = sim + mask.reshape(bs, -1, mask.shape[-2], mask.shape[-1]).to(sim.dtype)
    out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1).to(v.dtype), v)
    return _merge(out, skip_output_reshape)


def attention_split(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """Neo slices the queries to fit free memory; the same math here, unsliced."""
    return attention_basic(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape)


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    """PyTorch's SDPA; the mask is handed over as SDPA reads it (bool: True attends; float: added)."""
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask), dropout_p=0.0,
                                                           is_causal=False)
    return _merge(out, skip_output_reshape)


def attention_xformers(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return attention_pytorch(q, k, v, heads, mask, skip_reshape=skip_reshape, **kwargs)
    import xformers.ops  # imported by Neo only when xformers_enabled()
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = xformers.ops.memory_efficient_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=_sdpa_mask(mask))
    return _merge(out.transpose(1, 2), skip_output_reshape)


def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kwargs):
    from sageattention import sageattn  # imported by Neo only when sage_enabled()
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = sageattn(q, k, v, attn_mask=_sdpa_mask(mask), is_causal=False, tensor_layout="HND")
    return _merge(out, skip_output_reshape)


def attention_flash(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """flash-attn without a mask; Neo falls back to SDPA when flash-attn raises (a mask, a CPU tensor)."""
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    try:
        assert mask is None
        from flash_attn import flash_attn_func
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    except Exception:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask))
    return _merge(out, skip_output_reshape)


if memory_management.sage_enabled():
    attention_function = attention_sage
elif memory_management.flash_enabled():
    attention_function = attention_flash
elif memory_management.xformers_enabled():
    attention_function = attention_xformers
elif memory_management.pytorch_attention_enabled():
    attention_function = attention_pytorch
elif args.attention_split:
    attention_function = attention_split
else:
    attention_function = attention_basic


# --- VAE: one head over the pixels, (B, C, H, W) in and out ---------------------------------------

def slice_attention_single_head_spatial(q, k, v):
    """q (b, hw, c), k (b, c, hw), v (b, c, hw) -> (b, c, hw)."""
    s = torch.bmm(q, k) * int(q.shape[-1]) ** -0.5
    return torch.bmm(v, torch.nn.functional.softmax(s, dim=2).permute(0, 2, 1))


def normal_attention_single_head_spatial(q, k, v):
    b, c = q.shape[:2]
    out = slice_attention_single_head_spatial(q.reshape(b, c, -1).permute(0, 2, 1), k.reshape(b, c, -1),
                                              v.reshape(b, c, -1))
    return out.reshape(q.shape)


def xformers_attention_single_head_spatial(q, k, v):
    import xformers.ops
    B, C = q.shape[:2]
    q2, k2, v2 = (t.view(B, C, -1).transpose(1, 2).contiguous() for t in (q, k, v))
    return xformers.ops.memory_efficient_attention(q2, k2, v2, attn_bias=None).transpose(1, 2).reshape(q.shape)


def pytorch_attention_single_head_spatial(q, k, v):
    """SDPA on a (B, 1, HW, C) view: the head dim is C."""
    B, C = q.shape[:2]
    q2, k2, v2 = (t.view(B, 1, C, -1).transpose(2, 3).contiguous() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=None, dropout_p=0.0, is_causal=False)
    return out.transpose(2, 3).reshape(q.shape)


if memory_management.xformers_enabled_vae():
    attention_function_single_head_spatial = xformers_attention_single_head_spatial
elif memory_management.pytorch_attention_enabled():
    attention_function_single_head_spatial = pytorch_attention_single_head_spatial
else:
    attention_function_single_head_spatial = normal_attention_single_head_spatial
