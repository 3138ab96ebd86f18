"""The block-sparse design that needs nothing beyond PyTorch 2.1: each query block's kept key blocks are
gathered into a short key sequence, and PyTorch's own SDPA runs over it, a chunk of query blocks at a
time (every query block of the chunk as one batch entry).

Memory: the gathered keys and values of one chunk, at most ``CHUNK_ROWS`` rows each, whatever the call's
length; nothing proportional to the call besides the output. A block of keys that runs past the end of
the sequence (its last, shorter block) and the filler entries of a ragged routing are masked out.

With a pooled routing (``Routing.pooled``) every key block's mean key and mean value join each chunk's
keys and values, one row per block: a query block's own routed blocks are masked out of them, and the
others' scores are raised by the log of their token count (an additive mask), so every block the query
block does not route still counts in the softmax as its tokens would if their keys were all the mean.
"""
from __future__ import annotations

import torch

from ... import _compat
from ..base import new_output
from .routing import Routing, pooled

#: Gathered key rows (and as many value rows) held at once per chunk of query blocks.
CHUNK_ROWS = 1 << 15


def run(q, k, v, scale: float, routing: Routing, block: int) -> torch.Tensor:
    """Attention of q over the key blocks ``routing`` keeps, q, k, v in (b, h, n, d)."""
    b, h, n, d = q.shape
    kv = k.shape[2]
    out = new_output((b, h, n, v.shape[-1]), q.dtype, q.device)
    nq, width = routing.indices.shape[2:]
    offsets = torch.arange(block, device=q.device)
    ragged = kv % block != 0 or routing.counts is not None
    slots = torch.arange(width, device=q.device)
    chunk = max(1, CHUNK_ROWS // (width * block))
    full_blocks = n // block
    if routing.pooled:
        nk = routing.key_blocks
        k_means, v_means = (pooled(t, block).to(q.dtype) for t in (k, v))
        sizes = torch.full((nk,), float(block), device=q.device)
        sizes[-1] = kv - (nk - 1) * block
        log_sizes = sizes.log().to(q.dtype)
    for bi in range(b):
        for hi in range(h):
            q2, k2, v2 = q[bi, hi], k[bi, hi], v[bi, hi]
            idx = routing.indices[bi, hi]
            counts = routing.counts[bi, hi] if routing.counts is not None else None
            if not ragged:  # whole blocks: copied block by block, not row by row
                k_blocks, v_blocks = k2.unflatten(0, (kv // block, block)), v2.unflatten(0, (kv // block, block))
            for start in range(0, nq, chunk):
                stop = min(nq, start + chunk)
                mask = None
                if routing.pooled:
                    keys, values, mask = _with_pooled(idx[start:stop], counts, start, stop, slots, block, kv, k2, v2,
                                                      k_means[bi, hi], v_means[bi, hi], log_sizes)
                elif ragged:
                    tokens = (idx[start:stop, :, None] * block + offsets).flatten(1)  # (c, width * block)
                    valid = tokens < kv
                    if counts is not None:
                        valid &= (slots[None, :] < counts[start:stop, None]).repeat_interleave(block, dim=1)
                    mask = valid[:, None, None, :]
                    flat = tokens.clamp(max=kv - 1).flatten()
                    # (chunk, 1, keys, d): PyTorch's fused CPU kernel takes 4-D inputs (3-D ones run its math path)
                    keys = k2.index_select(0, flat).view(stop - start, 1, -1, d)
                    values = v2.index_select(0, flat).view(stop - start, 1, -1, v2.shape[-1])
                else:
                    keys = k_blocks[idx[start:stop]].flatten(1, 2)[:, None]
                    values = v_blocks[idx[start:stop]].flatten(1, 2)[:, None]
                whole = min(stop, full_blocks)
                if whole > start:  # query blocks of ``block`` rows, as a batch
                    rows = q2[start * block:whole * block].unflatten(0, (whole - start, 1, block))
                    part = _compat.TORCH_SDPA(rows, keys[:whole - start], values[:whole - start],
                                                          attn_mask=None if mask is None else mask[:whole - start],
                                                          scale=scale)
                    out[bi, hi, start * block:whole * block] = part.flatten(0, 2)
                if stop > whole:  # the last query block, shorter than ``block``
                    rows = q2[whole * block:][None, None]
                    j = whole - start
                    part = _compat.TORCH_SDPA(rows, keys[j:j + 1], values[j:j + 1],
                                                          attn_mask=None if mask is None else mask[j:j + 1],
                                                          scale=scale)
                    out[bi, hi, whole * block:] = part[0, 0]
    return out


def _with_pooled(idx, counts, start, stop, slots, block, kv, k2, v2, k_means, v_means, log_sizes):
    """(keys, values, additive mask) of a chunk of query blocks under a pooled routing: the routed blocks'
    tokens, then one mean key and value per key block, the routed ones masked out and the others' scores
    raised by the log of their token count."""
    c, width = idx.shape
    nk = k_means.shape[0]
    offsets = torch.arange(block, device=idx.device)
    tokens = (idx[:, :, None] * block + offsets).flatten(1)  # (c, width * block)
    valid = tokens < kv
    taken = (slots[None, :] < counts[start:stop, None]) if counts is not None else \
        torch.ones((c, width), dtype=torch.bool, device=idx.device)
    valid &= taken.repeat_interleave(block, dim=1)
    flat = tokens.clamp(max=kv - 1).flatten()
    keys = torch.cat([k2.index_select(0, flat).view(c, -1, k2.shape[-1]), k_means.expand(c, nk, -1)], dim=1)
    values = torch.cat([v2.index_select(0, flat).view(c, -1, v2.shape[-1]), v_means.expand(c, nk, -1)], dim=1)
    routed = torch.zeros((c, nk), dtype=torch.bool, device=idx.device).scatter_(1, idx, taken)
    neg = torch.finfo(log_sizes.dtype).min
    token_part = torch.zeros(valid.shape, dtype=log_sizes.dtype, device=idx.device).masked_fill_(~valid, neg)
    pooled_part = log_sizes.expand(c, nk).masked_fill(routed, neg)
    mask = torch.cat([token_part, pooled_part], dim=1)
    return keys[:, None], values[:, None], mask[:, None, None, :]
