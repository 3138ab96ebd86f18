"""Which key blocks each query block computes, chosen from pooled scores.

Queries and keys are mean-pooled per block of ``block`` tokens (the last block may be shorter); the
pooled scores (one per query block and key block, scaled as the call is) rank the key blocks for each
query block. ``topk`` keeps a fixed number of them (the fraction of the key blocks, rounded down: at
most that share, but never fewer than the blocks always kept), ``threshold the fewest whose share of the pooled
softmax mass (each key block weighted by its token count) reaches the threshold. The first key block
(a sink: conditioning tokens and the first frame hold mass in most models) and, for self-attention,
the query block's own block (the diagonal: local structure) are always kept, and so are the blocks of a
joint call's conditioning tokens where the host told them (``lib_attn.conditioning``).

Cost: one pass over q and k for the means, and a (q blocks x key blocks) score matrix per head:
at 75,600 tokens and 128-token blocks, 591 x 591 fp32 per head (1.4 MiB).
"""
from __future__ import annotations

import math

import torch

from ..sparse import Routing


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def pooled(x: torch.Tensor, block: int) -> torch.Tensor:
    """(b, h, n, d) -> (b, h, blocks, d): each block's mean in fp32 (views: no copy of ``x``)."""
    b, h, n, d = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(x[:, :, :full * block].unflatten(2, (full, block)).mean(dim=3, dtype=torch.float32))
    if n % block:
        parts.append(x[:, :, full * block:].mean(dim=2, keepdim=True, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int) -> torch.Tensor:
    """Pooled scores, (b, h, q_blocks, key_blocks), fp32."""
    return torch.matmul(pooled(q, block), pooled(k, block).transpose(-1, -2)).mul_(scale)


def _forced(s: torch.Tensor, text: tuple[int, int] | None = None) -> torch.Tensor:
    """A bool (q_blocks, key_blocks) of the blocks every row keeps: the first key block, the diagonal and
    the key blocks ``text`` ``[start, end)`` (a joint call's conditioning tokens)."""
    nq, nk = s.shape[-2:]
    keep = torch.zeros((nq, nk), dtype=torch.bool, device=s.device)
    keep[:, 0] = True
    if nq == nk:
        keep.fill_diagonal_(True)
    if text is not None:
        keep[:, text[0]:text[1]] = True
    return keep


def route(q, k, scale: float, block: int, knob_name: str, value: float, pooled_rest: bool = False,
          s: torch.Tensor | None = None, text: tuple[int, int] | None = None) -> Routing:
    """The routing of a call (q, k in (b, h, n, d)) at ``knob_name`` = ``value`` (see the module);
    ``pooled_rest``: the blocks not kept count through their pooled term (``Routing.pooled``); ``s``: the
    pooled scores when already computed (``scores``); ``text``: the blocks ``[start, end)`` holding a joint
    call's conditioning tokens, kept as keys by every query block and computed exactly as queries
    (``Routing.exact_rows``)."""
    s = scores(q, k, scale, block) if s is None else s
    nk = s.shape[-1]
    forced = _forced(s, text)
    if knob_name == "topk":
        width = min(nk, max(int(forced.sum(-1).max()), math.floor(value * nk + 1e-9)))
        ranked = s.masked_fill(forced, float("inf"))
        return Routing(ranked.topk(width, dim=-1, sorted=False).indices, None, nk, block, pooled_rest, text)
    # threshold: the fewest blocks, by pooled mass, whose mass reaches ``value``
    sizes = torch.full((nk,), float(block), device=s.device)
    sizes[-1] = k.shape[2] - (nk - 1) * block
    mass = torch.softmax(s + sizes.log(), dim=-1)
    order = mass.masked_fill(forced, 2.0).argsort(dim=-1, descending=True)  # forced blocks first
    ordered = mass.gather(-1, order)
    before = ordered.cumsum(-1).sub_(ordered)  # the mass of the blocks ahead of each: a prefix is taken
    counts = torch.maximum((before < value).sum(-1), forced.sum(-1))
    width = int(counts.max())
    return Routing(order[..., :width].contiguous(), counts if int(counts.min()) < width else None, nk, block,
                   pooled_rest, text)
