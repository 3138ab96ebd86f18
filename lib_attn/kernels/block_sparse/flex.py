"""The block-sparse design on PyTorch's FlexAttention (torch 2.5 and later): the routing becomes a
``BlockMask`` built from the block indices themselves (``BlockMask.from_kv_blocks``: no dense mask is
ever made, which at 16,384 tokens takes seconds on a CPU), and ``flex_attention`` compiled with
``torch.compile`` computes only the blocks it lists, on CUDA and on a CPU, returning the log-sum-exp.

The first call of each shape
compiles (seconds); a compiler that fails (no C++ compiler for a CPU build, no Triton for a GPU) is
remembered with its reason, and the gather design serves from then on.
"""
from __future__ import annotations

import torch

from ... import _compat

_compiled = None


def available() -> bool:
    return _compat.FLEX_ATTENTION is not None


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_compat.FLEX_ATTENTION)
    return _compiled


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
    """(out, lse or None) of q over the key blocks ``routing`` keeps, q, k, v in (b, h, n, d); lse
    (b, h, n) fp32 where ``gives_lse``."""
    mask = block_mask(routing, q.shape[2], k.shape[2], block)
    if not gives_lse(q.device.type):
        return _kernel()(q, k, v, block_mask=mask, scale=scale), None
    out, aux = _kernel()(q, k, v, block_mask=mask, scale=scale, **_compat.FLEX_LSE_ARGUMENTS)
    return out, (aux.lse if hasattr(aux, "lse") else aux)
