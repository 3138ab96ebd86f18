"""Double of ComfyUI 0.19.3's comfy/ldm/pixart/blocks.py: imports ``optimized_attention`` by name; the
cross-attention calls it on ``(B, L, heads*d)`` with ``mask=None`` and no transformer options, the
KV-compressed self-attention on ``(B, heads, L, d)`` with ``skip_reshape=True``."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, cond, mask=None):
        B, N, C = x.shape
        q = self.q_linear(x)
        k, v = self.kv_linear(cond).chunk(2, dim=-1)
        x = optimized_attention(q.view(B, -1, C), k.reshape(B, -1, C), v.reshape(B, -1, C), self.num_heads, mask=None)
        return self.proj(x)


class AttentionKVCompress(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None, HW=None, block_id=None):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, C).unbind(2)
        q, k, v = (t.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        x = optimized_attention(q, k, v, self.num_heads, mask=None, skip_reshape=True)
        return self.proj(x.view(B, N, C))
