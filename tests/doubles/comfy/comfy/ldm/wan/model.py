"""Double of ComfyUI's comfy/ldm/wan/model.py: imports ``optimized_attention`` by name and calls it with
``heads=`` and the transformer options on ``(b, s, heads*d)`` tensors."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, transformer_options={}):
        return self.o(optimized_attention(self.q(x), self.k(x), self.v(x), heads=self.num_heads,
                                          transformer_options=transformer_options))
