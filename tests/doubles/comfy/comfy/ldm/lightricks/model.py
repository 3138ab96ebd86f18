"""Double of ComfyUI 0.19.3's comfy/ldm/lightricks/model.py (LTXV; LTX-2's ``LTXAVModel`` builds on it):
imports the attention module itself (``import comfy.ldm.modules.attention``), and ``CrossAttention``
calls ``comfy.ldm.modules.attention.optimized_attention`` through that module, with ``attn_precision=``
and the transformer options, on ``(B, S, heads*d)``; ``optimized_attention_masked`` when it has a mask.
``LTXVModel`` runs ``transformer_blocks`` of self-attention (``attn1``) then cross-attention to the text
(``attn2``) on the latent's tokens (no RoPE, no norms, no timestep modulation)."""
import torch
from torch import nn

import comfy.ldm.modules.attention


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=4, dim_head=8, attn_precision=None):
        super().__init__()
        self.heads, self.attn_precision = heads, attn_precision
        inner = heads * dim_head
        context_dim = query_dim if context_dim is None else context_dim
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k, self.to_v = nn.Linear(context_dim, inner), nn.Linear(context_dim, inner)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None, mask=None, transformer_options={}):
        source = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(source), self.to_v(source)
        attention = comfy.ldm.modules.attention
        if mask is None:
            out = attention.optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,
                                                transformer_options=transformer_options)
        else:
            out = attention.optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                                                       transformer_options=transformer_options)
        return self.to_out(out)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, context_dim):
        super().__init__()
        self.attn1 = CrossAttention(dim, heads=n_heads, dim_head=d_head)
        self.attn2 = CrossAttention(dim, context_dim, heads=n_heads, dim_head=d_head)

    def forward(self, x, context=None, transformer_options={}):
        x = x + self.attn1(x, transformer_options=transformer_options)
        return x + self.attn2(x, context=context, transformer_options=transformer_options)


class LTXVModel(nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=4, context_dim=32, num_layers=2):
        super().__init__()
        self.patchify_proj = nn.Linear(in_channels, dim)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(dim, heads, dim // heads, context_dim)
                                                 for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        tokens = self.patchify_proj(x.flatten(2).transpose(1, 2))
        for block in self.transformer_blocks:
            tokens = block(tokens, context=context, transformer_options=transformer_options)
        return self.proj_out(tokens).transpose(1, 2).reshape(b, c, h, w)
