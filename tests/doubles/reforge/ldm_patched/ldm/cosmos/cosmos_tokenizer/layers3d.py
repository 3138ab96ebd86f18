"""Double of reForge's ldm_patched/ldm/cosmos/cosmos_tokenizer/layers3d.py: ``CausalAttnBlock`` stores
``vae_attention()`` on itself when built and calls it per frame (time folded into the batch); its causal
3-D convolutions are 1x1x1 here, which the attention path does not see."""
import torch
from torch import nn

from ldm_patched.ldm.modules.diffusionmodules.model import vae_attention


def time2batch(x):
    batch_size = x.shape[0]
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w), batch_size


def batch2time(x, batch_size):
    bt, c, h, w = x.shape
    return x.reshape(batch_size, bt // batch_size, c, h, w).permute(0, 2, 1, 3, 4)


class CausalAttnBlock(nn.Module):
    def __init__(self, in_channels: int, num_groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(num_groups, in_channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv3d(in_channels, in_channels, 1) for _ in range(4))
        self.optimized_attention = vae_attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_ = self.norm(x)
        q, batch_size = time2batch(self.q(h_))
        k, batch_size = time2batch(self.k(h_))
        v, batch_size = time2batch(self.v(h_))
        h_ = batch2time(self.optimized_attention(q, k, v), batch_size)
        return x + self.proj_out(h_)
