"""The block-sparse design on PyTorch's FlexAttention (torch 2.5 and later): the routing becomes a
``BlockMask`` built from the block indices themselves (``BlockMask.from_kv_blocks``: no dense mask is
ever made, which at 16,384 tokens takes seconds on a CPU), and ``flex_attention`` compiled with
``torch.compile`` computes only the blocks it lists, on CUDA and on a CPU, returning the log-sum-exp.

With a pooled routing (``Routing.pooled``) the keys and values are followed by each key block's mean key
and mean value (one row per block, after the sequence padded to whole blocks): every query block computes
its routed blocks in full and the pooled rows' blocks through a mask (a query block's own routed blocks'
rows masked out) and a score modifier (the log of the block's token count added).

The first call of each shape compiles (seconds); a compiler that fails (no C++ compiler for a CPU build,
no Triton for a GPU) is remembered with its reason for the device, dtype and head dim it failed on, and
the gather design serves those. ``torch.compile`` is not safe to enter from two threads at once: calls
of a shape not yet compiled run one at a time.
"""
from __future__ import annotations

import threading

import torch

from ... import _compat
from .routing import pooled

_compiled = None
_lock = threading.Lock()
#: The (device type, dtype, shapes, pooled) calls compiled and run once: they run without the lock.
_warm: set = set()


def available() -> bool:
    return _compat.FLEX_ATTENTION is not None


def _kernel():
    global _compiled
    with _lock:
        if _compiled is None:
            _compiled = torch.compile(_compat.FLEX_ATTENTION)
    return _compiled


def _call(q, k, v, mask, scale, pooled_rest, **extra):
    """The compiled kernel, under the lock until this kind of call has run once."""
    key = (q.device.type, q.dtype, tuple(q.shape), tuple(k.shape), pooled_rest, bool(extra))
    if isinstance(mask, _Modded):
        extra = dict(extra, score_mod=mask.score_mod)
        mask = mask.mask
    kernel = _kernel()
    if key in _warm:
        return kernel(q, k, v, block_mask=mask, scale=scale, **extra)
    with _lock:
        out = kernel(q, k, v, block_mask=mask, scale=scale, **extra)
        _warm.add(key)
    return out


def block_mask(routing, n: int, kv: int, block: int):
    """The ``BlockMask`` of ``routing`` for a call of ``n`` queries and ``kv`` keys."""
    indices = routing.indices.to(torch.int32)
    b, h, nq, width = indices.shape
    counts = (routing.counts.to(torch.int32) if routing.counts is not None
              else torch.full((b, h, nq), width, dtype=torch.int32, device=indices.device))
    extra = {}
    if _compat.FLEX_TAKES_SEQ_LENGTHS:
        extra["seq_lengths"] = (n, kv)
    if width < routing.key_blocks:  # the table's width is read as the number of key blocks
        indices = torch.nn.functional.pad(indices, (0, routing.key_blocks - width))
    if _compat.FLEX_SKIPS_Q_BLOCKS:
        extra["compute_q_blocks"] = False  # the transposed tables serve a backward pass only
    return _compat.FLEX_BLOCK_MASK.from_kv_blocks(counts, indices, BLOCK_SIZE=block, **extra)


def gives_lse(device_type: str) -> bool:
    """Compiled FlexAttention returns the log-sum-exp on CUDA; on a CPU its compiled kernel does not."""
    return device_type == "cuda"


def run(q, k, v, scale: float, routing, block: int):
    """(out, lse or None) of q over the key blocks ``routing`` keeps (and the pooled rest, for a pooled
    routing), q, k, v in (b, h, n, d); lse (b, h, n) fp32 where ``gives_lse``."""
    if routing.pooled:
        k, v, mask = _pooled_call(q, k, v, routing, block)
    else:
        mask = block_mask(routing, q.shape[2], k.shape[2], block)
    if not gives_lse(q.device.type):
        return _call(q, k, v, mask, scale, routing.pooled), None
    out, aux = _call(q, k, v, mask, scale, routing.pooled, **_compat.FLEX_LSE_ARGUMENTS)
    return out, (aux.lse if hasattr(aux, "lse") else aux)


def _indices(table: torch.Tensor):
    """(counts, indices) of a (b, h, rows, blocks) bool table: each row's True blocks first."""
    counts = table.sum(-1, dtype=torch.int32)
    order = table.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


def _pooled_call(q, k, v, routing, block: int):
    """(keys, values, BlockMask) of a pooled routing: the sequence padded to whole blocks, then one mean
    key and value per key block (padded to whole blocks too). Routed blocks are full blocks (the last,
    shorter one partial); the pooled rows are partial blocks whose mask drops a query block's own routed
    blocks and whose scores gain the log of their block's token count."""
    b, h, n, d = q.shape
    kv, nk = k.shape[2], routing.key_blocks
    base = nk * block
    extra = -(-nk // block)
    means_k, means_v = (pooled(t, block).to(t.dtype) for t in (k, v))

    def joined(x, means):
        pad = x.new_zeros((b, h, base - kv, x.shape[-1]))
        tail = x.new_zeros((b, h, extra * block - nk, x.shape[-1]))
        return torch.cat([x, pad, means, tail], dim=2)

    keys, values = joined(k, means_k), joined(v, means_v)
    nq, width = routing.indices.shape[2:]
    taken = (torch.arange(width, device=q.device) < routing.counts[..., None]) if routing.counts is not None else \
        torch.ones((b, h, nq, width), dtype=torch.bool, device=q.device)
    routed = torch.zeros((b, h, nq, nk), dtype=torch.bool, device=q.device).scatter_(-1, routing.indices, taken)
    ragged = kv % block != 0
    full = torch.zeros((b, h, nq, nk + extra), dtype=torch.bool, device=q.device)
    full[..., :nk] = routed
    partial = torch.zeros_like(full)
    partial[..., nk:] = True
    if ragged:  # the last key block is shorter: its padding is masked
        partial[..., nk - 1] = full[..., nk - 1]
        full[..., nk - 1] = False
    sizes = torch.full((nk,), float(block), device=q.device)
    sizes[-1] = kv - (nk - 1) * block
    log_sizes = sizes.log()
    # per pooled key row: its score's addition, the log of its block's token count where the query block
    # does not route that block, -inf where it does (and for the padding rows)
    bias = torch.full((b, h, nq, extra * block), float("-inf"), device=q.device)
    bias[..., :nk] = log_sizes.expand(b, h, nq, nk).masked_fill(routed, float("-inf"))

    def mask_mod(bi, hi, qi, ki):
        return (ki < kv) | (ki >= base)  # not the padding after the sequence (pooled rows: their bias)

    def score_mod(score, bi, hi, qi, ki):
        j = (ki - base).clamp(min=0)
        return torch.where(ki >= base, score + bias[bi, hi, qi // block, j].to(score.dtype), score)

    counts, indices = _indices(partial)
    full_counts, full_indices = _indices(full)
    args = {}
    if _compat.FLEX_TAKES_SEQ_LENGTHS:
        args["seq_lengths"] = (n, keys.shape[2])
    if _compat.FLEX_SKIPS_Q_BLOCKS:
        args["compute_q_blocks"] = False
    mask = _compat.FLEX_BLOCK_MASK.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=block,
                                                  mask_mod=mask_mod, **args)
    return keys, values, _Modded(mask, score_mod)


class _Modded:
    """A block mask with its score modifier, which ``_call`` passes on."""

    def __init__(self, mask, score_mod):
        self.mask, self.score_mod = mask, score_mod
