"""Double of ComfyUI 0.8.0's comfy/ldm/modules/attention.py.

Every attention function has the form ``(q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, **kwargs)`` and is wrapped by ``wrap_attn``: when the
call carries ``transformer_options`` holding ``optimized_attention_override``, the wrapper calls
``override(func, *args, **kwargs)`` instead (``func`` is the unwrapped function; ``kwargs`` include
``transformer_options`` and ``_inside_attn_wrapper=True``, which keeps the override from re-entering).

``optimized_attention`` is chosen once, at import: sage > xformers > flash > pytorch > split >
sub-quadratic (the CPU default); ``optimized_attention_masked`` is the same function. A
``--use-sage-attention`` / ``--use-flash-attention`` whose package is missing exits at import.
"""
import functools
import importlib.util
import logging
import sys

import torch
from torch import nn

from comfy import model_management
from comfy.cli_args import args

REGISTERED_ATTENTION_FUNCTIONS = {}


def register_attention_function(name, func):
    if name not in REGISTERED_ATTENTION_FUNCTIONS:
        REGISTERED_ATTENTION_FUNCTIONS[name] = func
    else:
        logging.warning(f"Attention function {name} already registered, skipping registration.")


def get_attention_function(name, default=...):
    if name == "optimized":
        return optimized_attention
    if name not in REGISTERED_ATTENTION_FUNCTIONS:
        if default is ...:
            raise KeyError(f"Attention function {name} not found.")
        return default
    return REGISTERED_ATTENTION_FUNCTIONS[name]


for _flag, _module in (("sage_attention_enabled", "sageattention"), ("flash_attention_enabled", "flash_attn")):
    if getattr(model_management, _flag)() and importlib.util.find_spec(_module) is None:
        logging.error(f"To use this feature, the `{_module}` package must be installed first.\n"
                      f"command:\n\t{sys.executable} -m pip install {_module}")
        exit(-1)

FORCE_UPCAST_ATTENTION_DTYPE = model_management.force_upcast_attention_dtype()


def get_attn_precision(attn_precision, current_dtype):
    if args.dont_upcast_attention:
        return None
    if FORCE_UPCAST_ATTENTION_DTYPE is not None and current_dtype in FORCE_UPCAST_ATTENTION_DTYPE:
        return FORCE_UPCAST_ATTENTION_DTYPE[current_dtype]
    return attn_precision


def wrap_attn(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        remove_key = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                transformer_options = kwargs.get("transformer_options", None)
                remove_key = True
                kwargs["_inside_attn_wrapper"] = True
                if transformer_options is not None and "optimized_attention_override" in transformer_options:
                    return transformer_options["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if remove_key:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


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


@wrap_attn
def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """Plain torch; a bool mask is read per batch item over the keys, an additive one is added."""
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


@wrap_attn
def attention_sub_quad(query, key, value, heads, mask=None, attn_precision=None, skip_reshape=False,
                       skip_output_reshape=False, **kwargs):
    """ComfyUI chunks queries and keys (the CPU default); the same math here, unchunked. A mask is
    added to the scores (a bool mask is turned into 0 / -inf first)."""
    attn_precision = get_attn_precision(attn_precision, query.dtype)
    q, k, v, d = _split_heads(query, key, value, heads, skip_reshape)
    compute = torch.float32 if attn_precision == torch.float32 else q.dtype
    sim = torch.einsum("bhid,bhjd->bhij", q.to(compute), k.to(compute)) * d ** -0.5
    if mask is not None:
        mask = _sdpa_mask(mask)
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=compute).masked_fill(~mask, float("-inf"))
        sim = sim + mask.to(compute)
    out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v.to(compute)).to(v.dtype)
    return _merge(out, skip_output_reshape)


@wrap_attn
def attention_split(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    attn_precision = get_attn_precision(attn_precision, q.dtype)
    return attention_basic(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape,
                           _inside_attn_wrapper=True)


# 0.19.3: PyTorch's kernels fail on batches above 2**15 on NVIDIA, so its function splits them there.
SDP_BATCH_LIMIT = 2 ** 15 if model_management.is_nvidia() else 2 ** 31


@wrap_attn
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    mask = _sdpa_mask(mask)
    pieces = []
    for i in range(0, q.shape[0], SDP_BATCH_LIMIT):
        part = mask if mask is None or mask.shape[0] == 1 else mask[i:i + SDP_BATCH_LIMIT]
        pieces.append(torch.nn.functional.scaled_dot_product_attention(
            q[i:i + SDP_BATCH_LIMIT], k[i:i + SDP_BATCH_LIMIT], v[i:i + SDP_BATCH_LIMIT], attn_mask=part,
            dropout_p=0.0, is_causal=False))
    return _merge(torch.cat(pieces), skip_output_reshape)


@wrap_attn
def attention_xformers(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
    import xformers.ops
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    out = xformers.ops.memory_efficient_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=_sdpa_mask(mask))
    return _merge(out.transpose(1, 2), skip_output_reshape)


@wrap_attn
def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                   **kwargs):
    if kwargs.get("low_precision_attention", True) is False:  # 0.19.3: such a call runs on PyTorch's
        return attention_pytorch(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                 skip_output_reshape=skip_output_reshape, **kwargs)
    from sageattention import sageattn
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    return _merge(sageattn(q, k, v, attn_mask=_sdpa_mask(mask), is_causal=False, tensor_layout="HND"),
                  skip_output_reshape)


@wrap_attn
def attention_flash(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    q, k, v, _ = _split_heads(q, k, v, heads, skip_reshape)
    try:
        if mask is not None:
            raise RuntimeError("Mask must not be set for Flash attention")
        from flash_attn import flash_attn_func
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    except Exception as e:
        logging.warning(f"Flash Attention failed, using default SDPA: {e}")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(mask))
    return _merge(out, skip_output_reshape)


optimized_attention = attention_basic
if model_management.sage_attention_enabled():
    optimized_attention = attention_sage
elif model_management.xformers_enabled():
    optimized_attention = attention_xformers
elif model_management.flash_attention_enabled():
    optimized_attention = attention_flash
elif model_management.pytorch_attention_enabled():
    optimized_attention = attention_pytorch
elif args.use_split_cross_attention:
    optimized_attention = attention_split
else:
    optimized_attention = attention_sub_quad

optimized_attention_masked = optimized_attention

register_attention_function("pytorch", attention_pytorch)
register_attention_function("sub_quad", attention_sub_quad)
register_attention_function("split", attention_split)


def optimized_attention_for_device(device, mask=False, small_input=False):
    """What text encoders ask for per forward (they pass no transformer options)."""
    if small_input:
        return attention_pytorch if model_management.pytorch_attention_enabled() else attention_basic
    if device == torch.device("cpu"):
        return attention_sub_quad
    return optimized_attention_masked if mask else optimized_attention


class CrossAttention(nn.Module):
    """SD1.5/SDXL's attention: the module globals, with the model's transformer options."""

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

    def forward(self, x, context=None, value=None, mask=None, transformer_options={}):
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(value if value is not None else context)
        if mask is None:
            out = optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                      transformer_options=transformer_options)
        else:
            out = optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                                             transformer_options=transformer_options)
        return self.to_out(out)
