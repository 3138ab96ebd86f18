"""Double of ComfyUI 0.19.3's comfy/ldm/flux/layers.py: its joint blocks as they reach attention (Flux's,
Chroma's, HunyuanVideo's and Hunyuan3D's double and single blocks).

Facts kept: ``DoubleStreamBlock.forward(img, txt, vec, pe, attn_mask=None, modulation_dims_img=None,
modulation_dims_txt=None, transformer_options={})`` projects each stream to (B, H, L, D) q, k, v, joins them
``torch.cat((txt_q, img_q), dim=2)`` (text first), puts ``img_slice = [txt.shape[1], q.shape[2]]`` on a copy
of the options (``extra_options``, which only ``attn1_patch`` patches see), calls
``comfy.ldm.flux.math.attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)``
and splits its output at ``txt.shape[1]``; returns ``(img, txt)``. ``SingleStreamBlock.forward(x, vec, pe,
attn_mask=None, modulation_dims=None, transformer_options={})`` attends over ``x`` as it comes. Modulation,
norms and MLPs are left out: they do not touch attention.
"""
import torch
from torch import nn

from comfy.ldm.flux.math import attention


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.img_qkv, self.txt_qkv = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, 3 * hidden_size)
        self.img_proj, self.txt_proj = nn.Linear(hidden_size, hidden_size), nn.Linear(hidden_size, hidden_size)

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}):
        extra_options = transformer_options.copy()
        img_q, img_k, img_v = self.img_qkv(img).view(img.shape[0], img.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        txt_q, txt_k, txt_v = self.txt_qkv(txt).view(txt.shape[0], txt.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        extra_options["img_slice"] = [txt.shape[1], q.shape[2]]
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
        return img + self.img_proj(img_attn), txt + self.txt_proj(txt_attn)


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, hidden_size)

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        return x + self.proj(attn)
