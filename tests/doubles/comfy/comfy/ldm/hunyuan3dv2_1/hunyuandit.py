"""Double of ComfyUI 0.19.3's comfy/ldm/hunyuan3dv2_1/hunyuandit.py: imports ``optimized_attention`` by
name; ``Attention`` and ``CrossAttention`` call it on ``(B, L, heads*d)`` with ``heads=`` and
``low_precision_attention=False``, and no transformer options. ``HunYuanDiTPlain`` runs ``blocks`` of
self- then cross-attention on the latent's tokens."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class CrossAttention(nn.Module):
    def __init__(self, qdim, kdim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, qdim // num_heads
        self.to_q = nn.Linear(qdim, qdim, bias=False)
        self.to_k = nn.Linear(kdim, qdim, bias=False)
        self.to_v = nn.Linear(kdim, qdim, bias=False)
        self.out_proj = nn.Linear(qdim, qdim)

    def forward(self, x, y):
        b, s1, _ = x.shape
        _, s2, _ = y.shape
        q, k, v = self.to_q(x), self.to_k(y), self.to_v(y)
        x = optimized_attention(q.reshape(b, s1, self.num_heads * self.head_dim),
                                k.reshape(b, s2, self.num_heads * self.head_dim), v,
                                heads=self.num_heads, low_precision_attention=False)
        return self.out_proj(x)


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, _ = x.shape
        x = optimized_attention(self.to_q(x), self.to_k(x), self.to_v(x), heads=self.num_heads,
                                low_precision_attention=False)
        return self.out_proj(x)


class HunYuanDiTBlock(nn.Module):
    def __init__(self, hidden_size, c_emb_size, num_heads):
        super().__init__()
        self.attn1 = Attention(hidden_size, num_heads)
        self.attn2 = CrossAttention(hidden_size, c_emb_size, num_heads)

    def forward(self, hidden_states, conditioning=None, text_states=None, skip_value=None):
        hidden_states = hidden_states + self.attn1(hidden_states)
        return hidden_states + self.attn2(hidden_states, text_states)


class HunYuanDiTPlain(nn.Module):
    def __init__(self, depth=2, hidden_size=32, num_heads=4, context_dim=32):
        super().__init__()
        self.x_embedder = nn.Linear(4, hidden_size)
        self.blocks = nn.ModuleList([HunYuanDiTBlock(hidden_size, context_dim, num_heads) for _ in range(depth)])
        self.final_layer = nn.Linear(hidden_size, 4)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        t = self.x_embedder(x.flatten(2).transpose(1, 2))
        for block in self.blocks:
            t = block(t, text_states=context)
        return self.final_layer(t).transpose(1, 2).reshape(B, C, H, W)
