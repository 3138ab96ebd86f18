"""Double of ComfyUI 0.19.3's comfy/ldm/pixart/pixartms.py: ``PixArtMS`` runs ``blocks`` of
``PixArtMSBlock`` (self-attention, then cross-attention on the caption), handing them no transformer
options. Tokens are the latent's pixels; no patch embedding, time embedding or modulation."""
from torch import nn

from .blocks import AttentionKVCompress, MultiHeadCrossAttention


class PixArtMSBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.attn = AttentionKVCompress(hidden_size, num_heads)
        self.cross_attn = MultiHeadCrossAttention(hidden_size, num_heads)

    def forward(self, x, y, t=None, mask=None, HW=None):
        x = x + self.attn(x, HW=HW)
        return x + self.cross_attn(x, y, mask)


class PixArtMS(nn.Module):
    def __init__(self, depth=2, hidden_size=32, num_heads=4, caption_channels=32):
        super().__init__()
        self.x_embedder = nn.Linear(4, hidden_size)
        self.y_embedder = nn.Linear(caption_channels, hidden_size)
        self.blocks = nn.ModuleList([PixArtMSBlock(hidden_size, num_heads) for _ in range(depth)])
        self.final_layer = nn.Linear(hidden_size, 4)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        t = self.x_embedder(x.flatten(2).transpose(1, 2))
        y = self.y_embedder(context)
        for block in self.blocks:
            t = block(t, y, HW=(H, W))
        return self.final_layer(t).transpose(1, 2).reshape(B, C, H, W)
