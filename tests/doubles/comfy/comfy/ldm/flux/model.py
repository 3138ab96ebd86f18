"""Double of ComfyUI's Flux: a single stream block's attention path on strided (B, H, L, D) views."""
import torch
from torch import nn

from comfy.ldm.flux.math import attention


class Flux(nn.Module):
    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.img_in = nn.Linear(4, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.final = nn.Linear(hidden, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        img = self.img_in(x.flatten(2).transpose(1, 2))
        L = img.shape[1]
        q, k, v = self.qkv(img).view(b, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        img = img + self.proj(attention(q, k, v, pe=None, transformer_options=transformer_options))
        return self.final(img).transpose(1, 2).reshape(b, c, h, w)
