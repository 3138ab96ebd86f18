"""Double of ComfyUI 0.19.3's comfy/ldm/hydit/models.py: ``HunYuanDiT`` runs ``blocks`` of
``HunYuanDiTBlock`` (self-attention, then cross-attention on the text), with ``attn_precision`` fp32
as ComfyUI's model config sets it, handing them no transformer options."""
import torch
from torch import nn

from .attn_layers import Attention, CrossAttention


class HunYuanDiTBlock(nn.Module):
    def __init__(self, hidden_size, c_emb_size, num_heads, attn_precision=None):
        super().__init__()
        self.attn1 = Attention(hidden_size, num_heads, attn_precision=attn_precision)
        self.attn2 = CrossAttention(hidden_size, c_emb_size, num_heads, attn_precision=attn_precision)

    def forward(self, x, c=None, text_states=None, freq_cis_img=None, skip=None):
        x = x + self.attn1(x, freq_cis_img)[0]
        return x + self.attn2(x, text_states, freq_cis_img)[0]


class HunYuanDiT(nn.Module):
    def __init__(self, depth=2, hidden_size=32, num_heads=4, text_states_dim=32, attn_precision=torch.float32):
        super().__init__()
        self.x_embedder = nn.Linear(4, hidden_size)
        self.blocks = nn.ModuleList([HunYuanDiTBlock(hidden_size, text_states_dim, num_heads, attn_precision)
                                     for _ in range(depth)])
        self.final_layer = nn.Linear(hidden_size, 4)

    def forward(self, x, timesteps, context=None, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        t = self.x_embedder(x.flatten(2).transpose(1, 2))
        for block in self.blocks:
            t = block(t, text_states=context)
        return self.final_layer(t).transpose(1, 2).reshape(B, C, H, W)
