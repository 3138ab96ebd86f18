"""Double of ComfyUI's comfy/cldm/cldm.py (the UNet ControlNet, SD1.5/SD2/SDXL): imports
``optimized_attention`` by name; the union ControlNet's ``OptimizedAttention`` calls it on
``(B, L, heads*d)`` with the heads positional and no transformer options."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class OptimizedAttention(nn.Module):
    def __init__(self, c, nhead):
        super().__init__()
        self.heads, self.c = nhead, c
        self.in_proj = nn.Linear(c, c * 3, bias=True)
        self.out_proj = nn.Linear(c, c, bias=True)

    def forward(self, x):
        x = self.in_proj(x)
        q, k, v = x.split(self.c, dim=2)
        out = optimized_attention(q, k, v, self.heads)
        return self.out_proj(out)
