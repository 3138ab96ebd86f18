"""Double of ComfyUI's comfy/ldm/modules/diffusionmodules/openaimodel.py: ``UNetModel``, here one
self-attention and one cross-attention layer, threading the transformer options as the real one does."""
from torch import nn

from comfy.ldm.modules.attention import CrossAttention


class UNetModel(nn.Module):
    def __init__(self, channels=64, context_dim=32, heads=4):
        super().__init__()
        self.proj_in = nn.Linear(4, channels)
        self.attn1 = CrossAttention(channels, heads=heads, dim_head=channels // heads)
        self.attn2 = CrossAttention(channels, context_dim=context_dim, heads=heads, dim_head=channels // heads)
        self.proj_out = nn.Linear(channels, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        t = self.proj_in(x.flatten(2).transpose(1, 2))
        t = t + self.attn1(t, transformer_options=transformer_options)
        t = t + self.attn2(t, context=context, transformer_options=transformer_options)
        return self.proj_out(t).transpose(1, 2).reshape(b, c, h, w)
