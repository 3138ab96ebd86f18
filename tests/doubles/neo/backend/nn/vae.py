"""Double of Forge Neo's backend/nn/vae.py: AttnBlock calls the by-name ``attention_function_single_head_spatial``."""
from torch import nn

from backend.attention import attention_function_single_head_spatial


def Normalize(in_channels, num_groups=32):
    return nn.GroupNorm(num_groups=num_groups, num_channels=in_channels, eps=1e-6, affine=True)


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels
        self.norm = Normalize(in_channels)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1)

    def forward(self, x):
        h_ = self.norm(x)
        h_ = attention_function_single_head_spatial(self.q(h_), self.k(h_), self.v(h_))
        return x + self.proj_out(h_)
