"""Double of ComfyUI 0.19.3's comfy/ldm/ernie/model.py: imports ``optimized_attention`` by name;
``ErnieImageAttention`` calls it on ``(B, S, heads*d)`` with ``mask=`` and no transformer options.
``ErnieImageModel`` runs its ``layers`` on the image tokens and the text together (no RoPE, no norms)."""
import torch
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class ErnieImageAttention(nn.Module):
    def __init__(self, query_dim, heads, dim_head):
        super().__init__()
        self.heads, self.head_dim = heads, dim_head
        inner = heads * dim_head
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, inner, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim, bias=False)])

    def forward(self, x, attention_mask=None, image_rotary_emb=None):
        B, S, _ = x.shape
        q_flat, k_flat, v_flat = self.to_q(x), self.to_k(x), self.to_v(x)
        hidden_states = optimized_attention(q_flat, k_flat, v_flat, self.heads, mask=attention_mask)
        return self.to_out[0](hidden_states)


class ErnieImageSharedAdaLNBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.self_attention = ErnieImageAttention(hidden_size, num_heads, hidden_size // num_heads)

    def forward(self, x, rotary_pos_emb=None, temb=None, attention_mask=None):
        return x + self.self_attention(x, attention_mask=attention_mask, image_rotary_emb=rotary_pos_emb)


class ErnieImageModel(nn.Module):
    def __init__(self, num_layers=2, hidden_size=32, num_attention_heads=4, text_in_dim=32):
        super().__init__()
        self.x_embedder = nn.Linear(4, hidden_size)
        self.text_proj = nn.Linear(text_in_dim, hidden_size)
        self.layers = nn.ModuleList([ErnieImageSharedAdaLNBlock(hidden_size, num_attention_heads)
                                     for _ in range(num_layers)])
        self.final_linear = nn.Linear(hidden_size, 4)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        img = self.x_embedder(x.flatten(2).transpose(1, 2))
        hidden = torch.cat([img, self.text_proj(context)], dim=1)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.final_linear(hidden[:, :H * W]).transpose(1, 2).reshape(B, C, H, W)
