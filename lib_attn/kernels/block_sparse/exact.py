"""The query rows a block-sparse call computes over every key (``Routing.exact_rows``: a joint call's
conditioning tokens, whose queries attend over the whole sequence): PyTorch's own SDPA on those rows,
written over the sparse design's output, and their log-sum-exp where the design returns one.

Cost: the rows' share of a dense call (512 text tokens of 12,800: 4%); memory: the log-sum-exp's scores
of one (batch, head) pair at a time, only where it is returned.
"""
from __future__ import annotations

import torch

from ... import _compat


def overwrite(out, lse, q, k, v, scale: float, routing) -> None:
    """Write exact attention over every key into ``out`` (b, h, n, d) and ``lse`` (b, h, n, or None) for
    the query rows of ``routing.exact_rows``; q, k, v in (b, h, n, d)."""
    if routing.exact_rows is None:
        return
    start, stop = (min(i * routing.block, q.shape[2]) for i in routing.exact_rows)
    if start >= stop:
        return
    rows = q[:, :, start:stop]
    out[:, :, start:stop] = _compat.TORCH_SDPA(rows, k, v, scale=scale).to(out.dtype)
    if lse is None:
        return
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    for bi in range(q.shape[0]):
        for hi in range(q.shape[1]):
            scores = (rows[bi, hi].to(compute) * scale) @ k[bi, hi].to(compute).T
            lse[bi, hi, start:stop] = torch.logsumexp(scores, dim=-1).to(lse.dtype)
