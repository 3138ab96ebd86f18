"""Double of ComfyUI's Flux: a single stream block's attention path on strided (B, H, L, D) views."""
import torch
from torch import nn

from comfy.ldm.flux.math import attention


class Flux(nn.Module):
    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.img_in = nn.Linear(4, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.final = nn.Linear(hidden, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        img = self.img_in(x.flatten(2).transpose(1, 2))
        L = img.shape[1]
        q, k, v = self.qkv(img).view(b, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        img = img + self.proj(attention(q, k, v, pe=None, transformer_options=transformer_options))
        return self.final(img).transpose(1, 2).reshape(b, c, h, w)


class FluxBlocks(nn.Module):
    """Double of the real ``Flux.forward_orig``'s block loop (0.19.3): the options copied, the double blocks
    called as ``block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=...)``, then
    ``img = torch.cat((txt, img), 1)``, ``transformer_options["img_slice"] = [txt.shape[1], img.shape[1]]`` and
    the single blocks called as ``block(img, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=...)``;
    the text's rows dropped after them."""

    def __init__(self, hidden=64, heads=4, double=2, single=2):
        from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock
        super().__init__()
        self.img_in, self.txt_in = nn.Linear(4, hidden), nn.Linear(32, hidden)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(hidden, heads) for _ in range(double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(hidden, heads) for _ in range(single))
        self.final = nn.Linear(hidden, 4)

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        transformer_options = transformer_options.copy()
        b, c, h, w = x.shape
        img, txt = self.img_in(x.flatten(2).transpose(1, 2)), self.txt_in(context)
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=None, pe=None, attn_mask=None, transformer_options=transformer_options)
        img = torch.cat((txt, img), 1)
        transformer_options["img_slice"] = [txt.shape[1], img.shape[1]]
        for block in self.single_blocks:
            img = block(img, vec=None, pe=None, attn_mask=None, transformer_options=transformer_options)
        img = img[:, txt.shape[1]:]
        return self.final(img).transpose(1, 2).reshape(b, c, h, w)
