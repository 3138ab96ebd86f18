"""Double of reForge's ldm_patched/ldm/wan/model.py: imports ``optimized_attention`` by name and calls it
with ``heads=`` as a keyword on ``(b, s, heads*d)`` tensors."""
from torch import nn

from ldm_patched.ldm.modules.attention import optimized_attention


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        return self.o(optimized_attention(self.q(x), self.k(x), self.v(x), heads=self.num_heads))
