"""Double of ComfyUI's comfy/ldm/modules/diffusionmodules/model.py: the VAE functions over (B, C, H, W)
maps (not wrapped by ``wrap_attn``: no override reaches them), ``vae_attention()`` choosing one, and
``AttnBlock`` storing it when built; ``forward(x)`` takes no transformer options."""
import torch
from torch import nn

from comfy import model_management


def slice_attention(q, k, v):
    s = torch.bmm(q, k) * int(q.shape[-1]) ** -0.5
    return torch.bmm(v, torch.nn.functional.softmax(s, dim=2).permute(0, 2, 1))


def normal_attention(q, k, v):
    b, c = q.shape[:2]
    out = slice_attention(q.reshape(b, c, -1).permute(0, 2, 1), k.reshape(b, c, -1), v.reshape(b, c, -1))
    return out.reshape(q.shape)


def xformers_attention(q, k, v):
    import xformers.ops
    B, C = q.shape[:2]
    q2, k2, v2 = (t.view(B, C, -1).transpose(1, 2).contiguous() for t in (q, k, v))
    return xformers.ops.memory_efficient_attention(q2, k2, v2, attn_bias=None).transpose(1, 2).reshape(q.shape)


def pytorch_attention(q, k, v):
    B, C = q.shape[:2]
    q2, k2, v2 = (t.view(B, 1, C, -1).transpose(2, 3).contiguous() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=None, dropout_p=0.0, is_causal=False)
    return out.transpose(2, 3).reshape(q.shape)


def vae_attention():
    if model_management.xformers_enabled_vae():
        return xformers_attention
    if model_management.pytorch_attention_enabled_vae():
        return pytorch_attention
    return normal_attention


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels
        self.norm = nn.GroupNorm(num_groups=32, num_channels=in_channels, eps=1e-6, affine=True)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(in_channels, in_channels, 1) for _ in range(4))
        self.optimized_attention = vae_attention()

    def forward(self, x):
        h_ = self.norm(x)
        h_ = self.optimized_attention(self.q(h_), self.k(h_), self.v(h_))
        return x + self.proj_out(h_)


class Decoder(nn.Module):
    """Enough of the VAE decoder to carry its attention: conv in, a mid attention block, conv out."""

    def __init__(self, z_channels=4, ch=64, out_ch=3):
        super().__init__()
        self.conv_in = nn.Conv2d(z_channels, ch, 3, padding=1)
        self.mid_attn_1 = AttnBlock(ch)
        self.conv_out = nn.Conv2d(ch, out_ch, 3, padding=1)

    def forward(self, z):
        return self.conv_out(self.mid_attn_1(self.conv_in(z)))
