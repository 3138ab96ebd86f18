"""Double of modules/models/sd3/mmdit.py: binds ``attention`` by name and calls it from SelfAttention."""
from torch import nn

from modules.models.sd3.other_impls import attention


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(attention(q, k, v, self.num_heads))
