"""Double of Forge Neo's backend/nn/t5.py: binds ``attention_pytorch`` as ``attention_function`` and passes
its additive relative-position bias as the mask."""
import torch
from torch import nn

from backend.attention import attention_pytorch as attention_function


class T5Attention(nn.Module):
    def __init__(self, model_dim, inner_dim, num_heads, relative_attention_num_buckets=8):
        super().__init__()
        self.q = nn.Linear(model_dim, inner_dim, bias=False)
        self.k = nn.Linear(model_dim, inner_dim, bias=False)
        self.v = nn.Linear(model_dim, inner_dim, bias=False)
        self.o = nn.Linear(inner_dim, model_dim, bias=False)
        self.num_heads = num_heads
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_bias = nn.Embedding(relative_attention_num_buckets, num_heads)

    def compute_bias(self, query_length, key_length, device, dtype):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        bucket = (memory_position - context_position).abs().clamp(max=self.relative_attention_num_buckets - 1)
        values = self.relative_attention_bias(bucket).to(dtype)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, x, mask=None, past_bias=None):
        q, k, v = self.q(x), self.k(x), self.v(x)
        past_bias = self.compute_bias(x.shape[1], x.shape[1], x.device, x.dtype)
        mask = past_bias if mask is None else mask + past_bias
        out = attention_function(q, k * ((k.shape[-1] / self.num_heads) ** 0.5), v, self.num_heads, mask)
        return self.o(out), past_bias
