"""sd-scripts' SD3 attention (``library/sd3_models.py``): q, k, v as (B, L, H*D), heads split by mode."""
import math

import torch
import torch.nn.functional as F


def _split(x, head_dim, mode):
    x = x.reshape(x.shape[0], x.shape[1], -1, head_dim)
    return x.transpose(1, 2) if mode in ("torch", "math") else x


def _merge(x, mode):
    if mode in ("torch", "math"):
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
    return x.reshape(x.shape[0], x.shape[1], -1)


def vanilla_attention(q, k, v, mask, scale=None):
    # 3-D batched matmuls, as sd-scripts' math mode: its (B, H, L, D) inputs make them fail.
    divisor = math.sqrt(q.size(-1)) if scale is None else scale
    probs = torch.softmax(torch.bmm(q, k.transpose(-1, -2)) / divisor, dim=-1)
    return torch.bmm(probs, v)


def memory_efficient_attention(q, k, v, attn_bias=None, scale=None):
    """xformers' call on (B, L, H, D); its maths, for the double."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias,
                                         scale=scale)
    return out.transpose(1, 2)


def attention(q, k, v, head_dim, mask=None, scale=None, mode="xformers"):
    q, k, v = (_split(t, head_dim, mode) for t in (q, k, v))
    k, v = k.to(q), v.to(q)
    if mode == "torch":
        assert scale is None
        out = F.scaled_dot_product_attention(q, k, v, mask)
    elif mode == "xformers":
        out = memory_efficient_attention(q, k, v, mask, scale=scale)
    else:
        out = vanilla_attention(q, k, v, mask, scale=scale)
    return _merge(out, mode)
