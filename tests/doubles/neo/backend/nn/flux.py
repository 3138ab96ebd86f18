"""Double of Forge Neo's backend/nn/flux.py: ``attention(q, k, v, pe, mask=None, transformer_options={})``
applies RoPE in fp32 and calls the by-name ``attention_function(q, k, v, heads, skip_reshape=True,
mask=mask, transformer_options=transformer_options)`` on strided (B, H, L, D) views, text tokens first.
"""
import torch
from torch import nn

from backend.attention import attention_function


def attention(q, k, v, pe, mask=None, transformer_options={}):
    if pe is not None:
        q, k = apply_rope(q, k, pe)
    heads = q.shape[1]
    return attention_function(q, k, v, heads, skip_reshape=True, mask=mask, transformer_options=transformer_options)


def rope(pos, dim, theta):
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta ** scale)
    out = pos.unsqueeze(-1) * omega.unsqueeze(0)
    cos_out, sin_out = torch.cos(out), torch.sin(out)
    out = torch.stack([cos_out, -sin_out, sin_out, cos_out], dim=-1)
    b, n, d, _ = out.shape
    return out.view(b, n, d, 2, 2).float()


def apply_rope(xq, xk, freqs_cis):
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


class EmbedND(nn.Module):
    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, axes_dim

    def forward(self, ids):
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_dtype = x.dtype
        x = x.float()
        rrms = torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms).to(dtype=x_dtype) * self.scale.to(x_dtype)


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)

    def qkv_views(self, x):
        """(B, L, 3, H, D) view permuted to three strided (B, H, L, D) tensors."""
        B, L, _ = x.shape
        qkv = self.qkv(x).view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = self.norm(q, k, v)
        return q, k, v


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.img_attn = SelfAttention(hidden_size, num_heads)
        self.txt_attn = SelfAttention(hidden_size, num_heads)

    def forward(self, img, txt, pe):
        img_q, img_k, img_v = self.img_attn.qkv_views(img)
        txt_q, txt_k, txt_v = self.txt_attn.qkv_views(txt)
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        attn = attention(q, k, v, pe=pe)
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
        return img + self.img_attn.proj(img_attn), txt + self.txt_attn.proj(txt_attn)


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.mlp_act = nn.GELU(approximate="tanh")

    def forward(self, x, pe):
        qkv, mlp = torch.split(self.linear1(x), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        B, L, _ = qkv.shape
        qkv = qkv.view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe)
        return x + self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
