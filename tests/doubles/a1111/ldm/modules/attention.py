"""Double of ldm/modules/attention.py: CrossAttention with its real attribute names and original forward."""
import torch
from torch import einsum, nn

from ldm.util import default, exists

XFORMERS_IS_AVAILBLE = False


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(context)
        b, n, inner = q.shape
        d = inner // h
        q, k, v = (t.reshape(b, -1, h, d).permute(0, 2, 1, 3).reshape(b * h, -1, d) for t in (q, k, v))
        sim = einsum("b i d, b j d -> b i j", q.float(), k.float()) * self.scale
        if exists(mask):
            keep = mask.reshape(b, -1).repeat_interleave(h, dim=0)[:, None, :]
            sim = sim.masked_fill(~keep, -torch.finfo(sim.dtype).max)
        sim = sim.softmax(dim=-1)
        out = einsum("b i j, b j d -> b i d", sim.to(v.dtype), v)
        out = out.reshape(b, h, -1, d).permute(0, 2, 1, 3).reshape(b, -1, h * d)
        return self.to_out(out)


class MemoryEfficientCrossAttention(CrossAttention):
    """In the real module this calls xformers; A1111's sd_hijack aliases the name to CrossAttention."""


class BasicTransformerBlock(nn.Module):
    ATTENTION_MODES = {"softmax": CrossAttention, "softmax-xformers": MemoryEfficientCrossAttention}
