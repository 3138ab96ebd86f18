"""Double of sgm/modules/diffusionmodules/model.py: sgm's AttnBlock (``attention(h_)`` + ``forward(x, **kwargs)``)."""
import torch
from torch import nn


def nonlinearity(x):
    return x * torch.sigmoid(x)


def Normalize(in_channels, num_groups=32):
    return nn.GroupNorm(num_groups=num_groups, num_channels=in_channels, eps=1e-6, affine=True)


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels
        self.norm = Normalize(in_channels)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)

    def attention(self, h_):
        h_ = self.norm(h_)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q, k, v = (t.reshape(b, 1, c, h * w).transpose(2, 3).contiguous() for t in (q, k, v))
        h_ = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return h_.transpose(2, 3).reshape(b, c, h, w)

    def forward(self, x, **kwargs):
        h_ = self.attention(x)
        h_ = self.proj_out(h_)
        return x + h_
