"""Double of reForge's ldm_patched/ldm/wan/vae.py: imports ``vae_attention`` (the VAE's chooser) from
the VAE model module; each ``AttentionBlock`` stores ``vae_attention()`` on itself when built and calls
``self.optimized_attention(q, k, v)`` on ``((b t), c, h, w)`` maps, one frame per batch row."""
from torch import nn

from ldm_patched.ldm.modules.diffusionmodules.model import vae_attention


class AttentionBlock(nn.Module):
    """Causal self-attention with one head (reForge's RMS norm reduced to a group norm)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.norm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.optimized_attention = vae_attention()

    def forward(self, x):
        identity = x
        b, c, t, h, w = x.size()
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        q, k, v = self.to_qkv(x).chunk(3, dim=1)
        x = self.proj(self.optimized_attention(q, k, v))
        return x.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity
