"""Double of reForge's ldm_patched/ldm/modules/attention.py.

Every multi-head function is ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False)`` (no ``**kwargs``): q/k/v ``(b, n, heads*d)``, or ``(b, heads, n, d)`` with
``skip_reshape``; the result ``(b, n, heads*d)``, or ``(b, heads, n, d)`` with ``skip_output_reshape``.

``optimized_attention`` is chosen once, at import: sage3 > sage > xformers > flash > pytorch > split
(``--attention-split``) > sub-quadratic; ``optimized_attention_masked`` is the same function. A
``--use-*`` flag whose package is missing makes the import exit the process, as reForge does.
``get_attn_precision(attn_precision, current_dtype)`` returns None under ``--force-upcast-attention``
(reForge's own rule) and the upcast map's dtype for half inputs.
"""
import importlib.util
import logging
import sys

import torch
from torch import nn

from ldm_patched.modules import model_management
from ldm_patched.modules.args_parser import args


def _require(enabled: bool, module: str, flag: str) -> None:
    if enabled and importlib.util.find_spec(module) is None:
        logging.error(f"To use the `{flag}` feature, the `{module}` package must be installed first.\n"
                      f"command:\n\t{sys.executable} -m pip install {module}")
        exit(-1)


_require(model_management.sage_attention_enabled(), "sageattention", "--use-sage-attention")
_require(model_management.sage_attention3_enabled(), "sageattn", "--use-sage-attention3")
_require(model_management.flash_attention_enabled(), "flash_attn", "--use-flash-attention")

FORCE_UPCAST_ATTENTION_DTYPE = model_management.force_upcast_attention_dtype()


def get_attn_precision(attn_precision, current_dtype):
    if args.force_upcast_attention:
        return None
    if FORCE_UPCAST_ATTENTION_DTYPE is not None and current_dtype in FORCE_UPCAST_ATTENTION_DTYPE:
        return FORCE_UPCAST_ATTENTION_DTYPE[current_dtype]
    return attn_precision


def _split_heads(q, k, v, heads, skip_reshape):
    if skip_reshape:
        return q, k, v, q.shape[-1]
    b, _, inner = q.shape
    d = inner // heads
    return (*(t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v)), d)


def _merge(out, skip_output_reshape):
    if skip_output_reshape:
        return out
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def _sdpa_mask(mask):
    if mask is not None and mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    """Plain torch; fp32 scores when the precision rule says so. A bool mask is read per batch item over
    the keys; an additive one is (n, m), (b|1, n, m) or with a heads axis."""
    attn_precision = get_attn_precision(attn_precision, q.dtype)
    q, k, v, d = _split_heads(q, k, v, heads, skip_reshape)
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


def attention_sub_quad(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    """reForge chunks queries and keys; the same math here, unchunked."""
    return attention_basic(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape)


def attention_split(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    return attention_basic(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape)


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask), dropout_p=0.0,
                                                           is_causal=False)
    return _merge(out, skip_output_reshape)


def attention_xformers(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    import xformers.ops
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = xformers.ops.memory_efficient_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=_sdpa_mask(mask))
    return _merge(out.transpose(1, 2), skip_output_reshape)


def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    from sageattention import sageattn
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    return _merge(sageattn(q, k, v, attn_mask=_sdpa_mask(mask), is_causal=False, tensor_layout="HND"),
                  skip_output_reshape)


attention_sage3 = attention_sage


def attention_flash(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False):
    """flash-attn; reForge falls back to SDPA on a mask or any error, logging it each time."""
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    try:
        assert mask is None
        from flash_attn import flash_attn_func
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    except Exception as e:
        logging.warning(f"Flash Attention failed, using default SDPA: {e}")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask))
    return _merge(out, skip_output_reshape)


optimized_attention = attention_basic
if model_management.sage_attention3_enabled():
    optimized_attention = attention_sage3
elif model_management.sage_attention_enabled():
    optimized_attention = attention_sage
elif model_management.xformers_enabled():
    optimized_attention = attention_xformers
elif model_management.flash_attention_enabled():
    optimized_attention = attention_flash
elif model_management.pytorch_attention_enabled():
    optimized_attention = attention_pytorch
elif args.attention_split:
    optimized_attention = attention_split
else:
    optimized_attention = attention_sub_quad

optimized_attention_masked = optimized_attention


def optimized_attention_for_device(device, mask=False, small_input=False):
    """What the text encoders ask for, per forward: never ``optimized_attention`` for small inputs."""
    if small_input:
        return attention_pytorch if model_management.pytorch_attention_enabled() else attention_basic
    if device == torch.device("cpu"):
        return attention_sub_quad
    return optimized_attention_masked if mask else optimized_attention


class CrossAttention(nn.Module):
    """SD1.5/SD2/SDXL: the module globals, read at call time; ``attn_precision`` from the model config."""

    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0, attn_precision=None):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = query_dim if context_dim is None else context_dim
        self.attn_precision = attn_precision
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, value=None, mask=None):
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(value if value is not None else context)
        if mask is None:
            out = optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision)
        else:
            out = optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision)
        return self.to_out(out)
