"""Double of Forge Neo's backend/nn/llm/llama.py (the LLM text encoders): binds the chosen
``attention_function`` at import and hands it to its layers as ``optimized_attention``, which call
it with ``skip_reshape=True`` and the causal/padding mask."""
import torch
from torch import nn

from backend.attention import attention_function


class Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, attention_mask=None, optimized_attention=None):
        b, s, _ = x.shape
        xq, xk, xv = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
                      for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(optimized_attention(xq, xk, xv, self.num_heads, mask=attention_mask, skip_reshape=True))


def causal_mask(s, dtype=torch.float32):
    return torch.full((s, s), float("-inf"), dtype=dtype).triu(1)


def encode(layer, x):
    """What the encoder does per layer: the function bound at import goes in as ``optimized_attention``."""
    return layer(x, causal_mask(x.shape[1], x.dtype), optimized_attention=attention_function)
