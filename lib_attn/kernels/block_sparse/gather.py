"""The block-sparse design that needs nothing beyond PyTorch 2.1: each query block's kept key blocks are
gathered into a short key sequence, and PyTorch's own SDPA runs over it, a chunk of query blocks at a
time (every query block of the chunk as one batch entry).

Memory: the gathered keys and values of one chunk, at most ``CHUNK_ROWS`` rows each, whatever the call's
length; nothing proportional to the call besides the output (and, for a pooled routing, one head's
log-sum-exp). A block of keys that runs past the end of the sequence (its last, shorter block) and the
filler entries of a ragged routing are masked out.

With a pooled routing (``Routing.pooled``) every key block the query block does not route still counts,
as its tokens would if their keys were all the block's mean: one score per block, the mean key's raised
by the log of the block's token count, over the mean value. Where PyTorch's SDPA returns its
log-sum-exp (its CPU kernel, torch 2.3 and later) that is a second pass, over the pooled keys alone
(a query row against one mean key per block: 1/128 of the dense scores), merged with the routed blocks'
output through the two log-sum-exps, so the routed blocks run unmasked on the gathered keys. Elsewhere
the mean keys and values join each chunk's gathered ones, under an additive mask that drops a query
block's own routed blocks and adds the log of the token counts.
"""
from __future__ import annotations

import torch

from ... import _compat
from ..base import new_output
from .routing import Routing, pooled

#: Gathered key rows (and as many value rows) held at once per chunk of query blocks.
CHUNK_ROWS = 1 << 15
#: Pooled scores (query rows x key blocks, fp32) held at once by the second pass.
POOLED_SCORES = 1 << 22


def merges_lse(device_type: str) -> bool:
    """Whether the pooled term runs as a second pass merged by log-sum-exp on ``device_type``: PyTorch's
    CPU SDPA kernel returns its log-sum-exp, and takes a mask, from torch 2.3."""
    return device_type == "cpu" and _compat.CPU_FLASH_OP is not None and _compat.CPU_FLASH_TAKES_MASK


def run(q, k, v, scale: float, routing: Routing, block: int) -> torch.Tensor:
    """Attention of q over the key blocks ``routing`` keeps (and the pooled rest, for a pooled routing),
    q, k, v in (b, h, n, d)."""
    b, h, n, d = q.shape
    kv = k.shape[2]
    out = new_output((b, h, n, v.shape[-1]), q.dtype, q.device)
    nq, width = routing.indices.shape[2:]
    slots = torch.arange(width, device=q.device)
    chunk = max(1, CHUNK_ROWS // (width * block))
    full_blocks = n // block
    merged = routing.pooled and merges_lse(q.device.type)
    if routing.pooled:
        nk = routing.key_blocks
        k_means, v_means = pooled(k, block), pooled(v, block)
        sizes = torch.full((nk,), float(block), device=q.device)
        sizes[-1] = kv - (nk - 1) * block
        log_sizes = sizes.log()
        # the second pass in fp32 (fp64 for fp64 calls); the mean keys joining the gathered ones in the call's dtype
        acc = torch.promote_types(q.dtype, torch.float32) if merged else q.dtype
        k_means, v_means, log_sizes = k_means.to(acc), v_means.to(acc), log_sizes.to(acc)
    lse = torch.empty(n, dtype=acc, device=q.device) if merged else None
    for bi in range(b):
        for hi in range(h):
            q2, k2, v2 = q[bi, hi], k[bi, hi], v[bi, hi]
            idx = routing.indices[bi, hi]
            counts = routing.counts[bi, hi] if routing.counts is not None else None
            for start in range(0, nq, chunk):
                stop = min(nq, start + chunk)
                if routing.pooled and not merged:
                    keys, values, mask = _with_pooled(idx[start:stop], counts, start, stop, slots, block, kv, k2, v2,
                                                      k_means[bi, hi], v_means[bi, hi], log_sizes)
                else:
                    keys, values, mask = _routed(idx[start:stop], counts, start, stop, slots, block, kv, k2, v2)
                    if merged and mask is not None:  # the CPU kernel's own operator takes an additive mask only
                        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, -torch.inf)
                whole = min(stop, full_blocks)
                spans = []
                if whole > start:  # query blocks of ``block`` rows, as a batch
                    spans.append((start * block, whole * block, q2[start * block:whole * block].unflatten(
                        0, (whole - start, 1, block)), slice(0, whole - start)))
                if stop > whole:  # the last query block, shorter than ``block``
                    j = whole - start
                    spans.append((whole * block, n, q2[whole * block:][None, None], slice(j, j + 1)))
                for lo, hi_row, rows, part in spans:
                    m = None if mask is None else mask[part]
                    if merged:
                        o, row_lse = _compat.CPU_FLASH_OP(rows, keys[part], values[part], attn_mask=m, scale=scale)
                        lse[lo:hi_row] = row_lse.flatten()
                    else:
                        o = _compat.TORCH_SDPA(rows, keys[part], values[part], attn_mask=m, scale=scale)
                    out[bi, hi, lo:hi_row] = o.flatten(0, 2)
            if merged:
                _merge_pooled(out[bi, hi], lse, q2, k_means[bi, hi], v_means[bi, hi], log_sizes, idx, counts, slots,
                              scale, block)
    return out


def _routed(idx, counts, start, stop, slots, block, kv, k2, v2):
    """(keys, values, mask or None) of a chunk of query blocks: their routed blocks' tokens, as
    (chunk, 1, tokens, d) (PyTorch's fused CPU kernel takes 4-D inputs; 3-D ones run its math path); the
    mask, where the last key block is short or the routing ragged, drops what is not a routed token."""
    c, width = idx.shape
    d, dv = k2.shape[-1], v2.shape[-1]
    if kv % block == 0 and counts is None:  # whole blocks: copied block by block, not row by row
        flat = idx.flatten()
        keys = k2.unflatten(0, (kv // block, block)).index_select(0, flat).view(c, 1, -1, d)
        values = v2.unflatten(0, (kv // block, block)).index_select(0, flat).view(c, 1, -1, dv)
        return keys, values, None
    offsets = torch.arange(block, device=idx.device)
    tokens = (idx[:, :, None] * block + offsets).flatten(1)  # (c, width * block)
    valid = tokens < kv
    if counts is not None:
        valid &= (slots[None, :] < counts[start:stop, None]).repeat_interleave(block, dim=1)
    flat = tokens.clamp(max=kv - 1).flatten()
    keys = k2.index_select(0, flat).view(c, 1, -1, d)
    values = v2.index_select(0, flat).view(c, 1, -1, dv)
    return keys, values, valid[:, None, None, :]


def _routed_table(idx, counts, slots, nk: int) -> torch.Tensor:
    """(q blocks, nk) bool: the key blocks each query block routes."""
    taken = (slots[None, :] < counts[:, None]) if counts is not None else \
        torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    return torch.zeros((idx.shape[0], nk), dtype=torch.bool, device=idx.device).scatter_(1, idx, taken)


def _merge_pooled(out, lse, q2, k_means, v_means, log_sizes, idx, counts, slots, scale: float, block: int):
    """The second pass of one head: each query row against every key block's mean key (its score raised by
    the log of the block's token count, and dropped where the row's query block routes the block), merged
    into ``out`` (the routed blocks' output, whose log-sum-exp is ``lse``) in place."""
    n = q2.shape[0]
    nk = k_means.shape[0]
    bias = log_sizes.masked_fill(_routed_table(idx, counts, slots, nk), float("-inf"))  # (q blocks, nk)
    step = max(block, POOLED_SCORES // nk // block * block)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        s = torch.matmul(q2[lo:hi].to(k_means.dtype), k_means.T).mul_(scale)
        s += bias.index_select(0, torch.arange(lo, hi, device=s.device) // block)
        routed_lse = lse[lo:hi]
        total = torch.logaddexp(routed_lse, torch.logsumexp(s, dim=-1))
        pooled_out = torch.matmul(s.sub_(total[:, None]).exp_(), v_means)
        pooled_out.addcmul_(out[lo:hi].to(pooled_out.dtype), routed_lse.sub(total).exp_()[:, None])
        out[lo:hi] = pooled_out


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
