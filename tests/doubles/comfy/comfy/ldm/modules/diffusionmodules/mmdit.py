"""Double of ComfyUI 0.19.3's comfy/ldm/modules/diffusionmodules/mmdit.py (SD3's MMDiT) as it reaches attention.

Facts kept: ``JointBlock.forward(*args, **kwargs)`` is ``block_mixing(*args, context_block=..., x_block=...,
**kwargs)``, called by the model as ``joint_blocks[i](context, x, c=c_mod, use_checkpoint=...,
transformer_options=...)``; ``_block_mixing`` joins each of q, k, v as ``torch.cat((context_qkv[t], x_qkv[t]),
dim=1)`` (the context first), calls ``optimized_attention(q, k, v, heads=..., transformer_options=...)`` on
(B, L, heads·d) and splits the output at the context's length; a block with ``x_block_self_attn`` (SD3.5)
runs a second ``optimized_attention`` over the image's own q, k, v. Modulation, norms and MLPs are left out.
"""
import torch
from torch import nn

from ..attention import optimized_attention


class JointBlock(nn.Module):
    def __init__(self, hidden, heads, x_block_self_attn=False):
        super().__init__()
        self.heads, self.x_block_self_attn = heads, x_block_self_attn
        self.context_qkv, self.x_qkv = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, 3 * hidden)
        self.x_qkv2 = nn.Linear(hidden, 3 * hidden)

    def forward(self, context, x, c=None, use_checkpoint=False, transformer_options={}):
        context_qkv, x_qkv = self.context_qkv(context).chunk(3, -1), self.x_qkv(x).chunk(3, -1)
        qkv = tuple(torch.cat((context_qkv[t], x_qkv[t]), dim=1) for t in range(3))
        attn = optimized_attention(qkv[0], qkv[1], qkv[2], heads=self.heads, transformer_options=transformer_options)
        context_attn, x_attn = attn[:, : context.shape[1]], attn[:, context.shape[1]:]
        if self.x_block_self_attn:
            x_qkv2 = self.x_qkv2(x).chunk(3, -1)
            x_attn = x_attn + optimized_attention(*x_qkv2, heads=self.heads, transformer_options=transformer_options)
        return context + context_attn, x + x_attn


class MMDiT(nn.Module):
    def __init__(self, hidden=64, heads=4, depth=2):
        super().__init__()
        self.x_in, self.context_in = nn.Linear(4, hidden), nn.Linear(32, hidden)
        self.joint_blocks = nn.ModuleList(JointBlock(hidden, heads, x_block_self_attn=i == 0) for i in range(depth))
        self.final = nn.Linear(hidden, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        x_tokens, context = self.x_in(x.flatten(2).transpose(1, 2)), self.context_in(context)
        for block in self.joint_blocks:
            context, x_tokens = block(context, x_tokens, c=None, use_checkpoint=False,
                                      transformer_options=transformer_options)
        return self.final(x_tokens).transpose(1, 2).reshape(b, c, h, w)
