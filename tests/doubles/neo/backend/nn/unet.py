"""Double of Forge Neo's backend/nn/unet.py: binds ``attention_function`` by name; SD1.5/SD2/SDXL's
``CrossAttention`` calls it as ``attention_function(q, k, v, self.heads, mask)``."""
from torch import nn

from backend.attention import attention_function


def default(val, d):
    return val if val is not None else d


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.heads = heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, value=None, mask=None, transformer_options={}):
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(value) if value is not None else self.to_v(context)
        out = attention_function(q, k, v, self.heads, mask)
        return self.to_out(out)
