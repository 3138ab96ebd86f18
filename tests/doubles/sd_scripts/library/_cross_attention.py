"""CrossAttention as sd-scripts' ``original_unet.py`` and ``sdxl_original_unet.py`` define it (each module has
its own class; SD1's also has a ``processor`` hook, called first)."""
import torch
import torch.nn.functional as F
from torch import nn


class CrossAttentionBase(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=8, dim_head=64, upcast_attention=False):
        super().__init__()
        inner = dim_head * heads
        context_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.upcast_attention = upcast_attention
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim)])
        self.use_memory_efficient_attention_xformers = False
        self.use_memory_efficient_attention_mem_eff = False
        self.use_sdpa = False

    def set_use_memory_efficient_attention(self, xformers, mem_eff):
        self.use_memory_efficient_attention_xformers = xformers
        self.use_memory_efficient_attention_mem_eff = mem_eff

    def set_use_sdpa(self, sdpa):
        self.use_sdpa = sdpa

    def _heads_to_batch(self, t):
        b, n, c = t.shape
        return t.reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3).reshape(b * self.heads, n, c // self.heads)

    def _batch_to_heads(self, t):
        bh, n, d = t.shape
        return t.reshape(bh // self.heads, self.heads, n, d).permute(0, 2, 1, 3).reshape(bh // self.heads, n, d * self.heads)

    def _paths(self, hidden_states, context, mask):
        if self.use_memory_efficient_attention_xformers:
            return self._fused(hidden_states, context, None)
        if self.use_memory_efficient_attention_mem_eff:
            return self._fused(hidden_states, context, mask)
        if self.use_sdpa:
            return self._fused(hidden_states, context, mask)
        q = self.to_q(hidden_states)
        context = context if context is not None else hidden_states
        k, v = self.to_k(context), self.to_v(context)
        q, k, v = self._heads_to_batch(q), self._heads_to_batch(k), self._heads_to_batch(v)
        if self.upcast_attention:
            q, k = q.float(), k.float()
        scores = torch.baddbmm(torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype, device=q.device),
                               q, k.transpose(-1, -2), beta=0, alpha=self.scale)
        probs = scores.softmax(dim=-1).to(v.dtype)
        return self.to_out[0](self._batch_to_heads(torch.bmm(probs, v)))

    def _fused(self, x, context, mask):
        """The xformers, mem_eff and sdpa paths: context in x's dtype, (B, H, L, D) maths."""
        h = self.heads
        q = self.to_q(x)
        context = (context if context is not None else x).to(x.dtype)
        k, v = self.to_k(context), self.to_v(context)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))
