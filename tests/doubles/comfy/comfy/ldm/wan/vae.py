"""Double of ComfyUI's comfy/ldm/wan/vae.py: ``AttentionBlock`` stores ``vae_attention()`` when built and
calls it on ``((b t), c, h, w)`` maps."""
from torch import nn

from comfy.ldm.modules.diffusionmodules.model import vae_attention


class AttentionBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.optimized_attention = vae_attention()

    def forward(self, x):
        identity = x
        b, c, t, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        q, k, v = self.to_qkv(self.norm(x)).chunk(3, dim=1)
        x = self.proj(self.optimized_attention(q, k, v))
        return x.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity
