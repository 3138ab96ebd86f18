"""Double of Forge Neo's backend/nn/wan_vae.py: imports the VAE function as ``vae_attention``; each
``AttentionBlock`` stores it on itself when built and calls ``self.optimized_attention(q, k, v)`` on
``((b t), c, h, w)`` maps."""
from torch import nn

from backend.attention import attention_function_single_head_spatial as vae_attention


class AttentionBlock(nn.Module):
    """Causal self-attention with one head, per frame."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.norm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.optimized_attention = vae_attention

    def forward(self, x):
        identity = x
        b, c, t, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(x)).chunk(3, dim=1)
        x = self.proj(self.optimized_attention(q, k, v))
        x = x.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + identity
