"""Double of Forge Classic's ldm_patched/ldm/modules/attention.py (the classic branch).

Every function is ``(q, k, v, heads, mask=None)``: q/k/v ``(b, n, heads*d)`` in, ``(b, n, heads*d)``
out; no precision argument: basic/split/sub-quadratic compute the scores in fp32 unless
``--disable-attention-upcast`` (``_ATTN_PRECISION``), SDPA and xformers in the inputs' dtype.
``optimized_attention`` is chosen once, at import: sage > xformers > pytorch > split > sub-quadratic;
``optimized_attention_masked`` is the same function. There is no flash-attn function.
"""
import torch
from torch import nn

from ldm_patched.modules import model_management
from ldm_patched.modules.args_parser import args

_ATTN_PRECISION = "fp16" if args.disable_attention_upcast else "fp32"


def _heads(t, b, heads, d):
    return t.reshape(b, -1, heads, d).transpose(1, 2)


def attention_basic(q, k, v, heads, mask=None):
    """A bool mask is read per batch item over the keys; an additive one is added to the scores."""
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (_heads(t, b, heads, d) for t in (q, k, v))
    if _ATTN_PRECISION == "fp32":
        sim = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) * d ** -0.5
    else:
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * d ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            keys = mask.reshape(mask.shape[0], -1)[:, None, None, :]
            sim = sim.masked_fill(~keys, -torch.finfo(sim.dtype).max)
        else:
            sim = sim + mask.to(sim.dtype)
    out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1).to(v.dtype), v)
    return out.transpose(1, 2).reshape(b, -1, heads * d)


def attention_sub_quad(query, key, value, heads, mask=None):
    """Classic chunks queries and keys; the same math here, unchunked."""
    return attention_basic(query, key, value, heads, mask)


def attention_split(q, k, v, heads, mask=None):
    return attention_basic(q, k, v, heads, mask)


def attention_xformers(q, k, v, heads, mask=None):
    import xformers.ops
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.reshape(b, -1, heads, d) for t in (q, k, v))
    return xformers.ops.memory_efficient_attention(q, k, v, attn_bias=mask).reshape(b, -1, heads * d)


def attention_pytorch(q, k, v, heads, mask=None):
    """SDPA, the mask handed over as it is."""
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (_heads(t, b, heads, d) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * d)


def attention_sage(q, k, v, heads, mask=None):
    from sageattention import sageattn
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.view(b, -1, heads, d) for t in (q, k, v))
    return sageattn(q, k, v, attn_mask=mask, is_causal=False, tensor_layout="NHD").reshape(b, -1, heads * d)


optimized_attention = attention_basic
if model_management.sage_enabled():
    optimized_attention = attention_sage
elif model_management.xformers_enabled():
    optimized_attention = attention_xformers
elif model_management.pytorch_attention_enabled():
    optimized_attention = attention_pytorch
elif args.attention_split:
    optimized_attention = attention_split
else:
    optimized_attention = attention_sub_quad

optimized_attention_masked = optimized_attention


def optimized_attention_for_device(device, mask=False, small_input=False):
    if small_input:
        return attention_pytorch if model_management.pytorch_attention_enabled() else attention_basic
    if device == torch.device("cpu"):
        return attention_sub_quad
    return optimized_attention_masked if mask else optimized_attention


class CrossAttention(nn.Module):
    """SD1.5/SDXL: the module globals, read at call time, with no precision argument."""

    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = query_dim if context_dim is None else context_dim
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, value=None, mask=None, transformer_options=None):
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(value if value is not None else context)
        if mask is None:
            out = optimized_attention(q, k, v, self.heads)
        else:
            out = optimized_attention_masked(q, k, v, self.heads, mask)
        return self.to_out(out)
