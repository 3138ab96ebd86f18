"""The always-available path: plain PyTorch, chunked over queries so memory stays bounded.

A fallback must never need the full (q, kv) score matrix: at SD1.5's largest call that matrix alone
is 1 GiB in fp32. Scores are built a block of query rows at a time, at most ``CHUNK_BYTES`` each.
"""
from __future__ import annotations

import torch

from ..spec import FLOATS, HALF
from .base import Backend, Status, default_scale, needs_grad, new_output

CHUNK_BYTES = 16 * 2**20


class Math(Backend):
    id = "math"
    label = "Chunked math (plain PyTorch, bounded memory)"
    devices = ("cuda", "cpu", "mps", "xpu")
    dtypes = FLOATS

    def _probe(self) -> Status:
        return Status(True, version=f"torch {torch.__version__}")

    def run(self, q, k, v, mask, scale):
        b, h, n, d = q.shape
        kv = k.shape[2]
        # Half inputs are computed in fp32: the path is a fallback, accuracy beats speed here.
        compute = torch.float32 if q.dtype in HALF else q.dtype
        scale = default_scale(scale, d)
        kt = k.to(compute).transpose(-1, -2)
        vc = v.to(compute)
        row_bytes = b * h * kv * torch.finfo(compute).bits // 8
        rows = max(1, min(n, CHUNK_BYTES // max(row_bytes, 1)))
        grad = needs_grad(q, k, v, mask)
        blocks = []
        out = None if grad else new_output((b, h, n, v.shape[-1]), q.dtype, q.device)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            scores = torch.matmul(q[:, :, start:stop].to(compute), kt)
            # With autograd on, in-place ops would overwrite what backward needs.
            scores = scores * scale if grad else scores.mul_(scale)
            if mask is not None:
                part = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask[..., start:stop, :]
                if part.dtype == torch.bool:
                    scores = scores.masked_fill(~part, float("-inf")) if grad else scores.masked_fill_(~part, float("-inf"))
                else:
                    scores = scores + part.to(compute)
            probs = torch.softmax(scores, dim=-1) if grad else _softmax_(scores)
            if grad:
                blocks.append(torch.matmul(probs, vc).to(q.dtype))
            else:
                out[:, :, start:stop] = torch.matmul(probs, vc)
        return torch.cat(blocks, dim=2) if grad else out


def _softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in place: one score buffer per chunk instead of three."""
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(dim=-1, keepdim=True))
