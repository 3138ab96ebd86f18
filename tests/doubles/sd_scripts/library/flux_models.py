"""sd-scripts' Flux attention (``library/flux_models.py``): rope, SDPA, heads merged; the T5 mask as its
blocks build it."""
import torch
from torch import Tensor


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    """Rotation matrices (..., n, dim/2, 2, 2) for positions ``pos``, in float32."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
    angles = pos.to(torch.float64)[..., None] * freqs
    cos, sin = torch.cos(angles), torch.sin(angles)
    rows = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return rows.float()


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor):
    """Rotate pairs of q's and k's last dimension in float32; back in their dtypes."""
    def turn(x):
        pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        out = freqs_cis[..., 0] * pairs[..., 0] + freqs_cis[..., 1] * pairs[..., 1]
        return out.reshape(*x.shape).type_as(x)
    return turn(xq), turn(xk)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, attn_mask=None) -> Tensor:
    q, k = apply_rope(q, k, pe)
    x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    b, h, n, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, n, h * d)


def t5_attn_mask(txt_attention_mask: Tensor, img_len: int, heads: int, q_len: int) -> Tensor:
    """The mask a block passes with ``--apply_t5_attn_mask``: text first then image, bool, expanded over
    heads and queries."""
    keys = torch.cat([txt_attention_mask.to(torch.bool),
                      torch.ones(txt_attention_mask.shape[0], img_len, dtype=torch.bool,
                                 device=txt_attention_mask.device)], dim=1)
    return keys[:, None, None, :].expand(-1, heads, q_len, -1)
