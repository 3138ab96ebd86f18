"""Double of ComfyUI 0.19.3's comfy/ldm/hydit/attn_layers.py: imports ``optimized_attention`` by name;
both attentions call it on ``(B, heads, L, d)`` with ``skip_reshape=True`` and ``attn_precision`` (fp32
for Hunyuan-DiT), and no transformer options."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class CrossAttention(nn.Module):
    def __init__(self, qdim, kdim, num_heads, attn_precision=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, qdim // num_heads
        self.attn_precision = attn_precision
        self.q_proj = nn.Linear(qdim, qdim)
        self.kv_proj = nn.Linear(kdim, 2 * qdim)
        self.out_proj = nn.Linear(qdim, qdim)

    def forward(self, x, y, freqs_cis_img=None):
        b, s1, c = x.shape
        _, s2, _ = y.shape
        q = self.q_proj(x).view(b, s1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(y).view(b, s2, 2, self.num_heads, self.head_dim).unbind(dim=2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        context = optimized_attention(q, k, v, self.num_heads, skip_reshape=True, attn_precision=self.attn_precision)
        return (self.out_proj(context),)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, attn_precision=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_precision = attn_precision
        self.Wqkv = nn.Linear(dim, dim * 3)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, freqs_cis_img=None):
        B, N, C = x.shape
        q, k, v = self.Wqkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = optimized_attention(q, k, v, self.num_heads, skip_reshape=True, attn_precision=self.attn_precision)
        return (self.out_proj(x),)
