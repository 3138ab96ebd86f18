"""Double of Forge Neo's backend/nn/wan.py: binds the chosen function as ``optimized_attention`` and calls
it with ``heads=`` as a keyword: self-attention on ``(b, s, n*d)`` views of RoPE'd q/k, text and image
cross-attention on projected contexts."""
import torch
from torch import nn

from backend.attention import attention_function as optimized_attention


def _rope(x, freqs):
    """A stand-in rotation with Wan's shapes: x (b, s, n, d) in, same out (computed in fp32)."""
    x_ = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
    out = torch.stack((x_[..., 0] * cos - x_[..., 1] * sin, x_[..., 0] * sin + x_[..., 1] * cos), dim=-1)
    return out.reshape(x.shape).type_as(x)


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x, freqs):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = _rope(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
        k = _rope(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
        x = optimized_attention(q.view(b, s, n * d), k.view(b, s, n * d), self.v(x).view(b, s, n * d),
                                heads=self.num_heads)
        return self.o(x)


class WanI2VCrossAttention(WanSelfAttention):
    def __init__(self, dim, num_heads):
        super().__init__(dim, num_heads)
        self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_k_img = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x, context, context_img_len):
        context_img, context = context[:, :context_img_len], context[:, context_img_len:]
        q = self.norm_q(self.q(x))
        k, v = self.norm_k(self.k(context)), self.v(context)
        k_img, v_img = self.norm_k_img(self.k_img(context_img)), self.v_img(context_img)
        img_x = optimized_attention(q, k_img, v_img, heads=self.num_heads)
        x = optimized_attention(q, k, v, heads=self.num_heads)
        return self.o(x + img_x)
