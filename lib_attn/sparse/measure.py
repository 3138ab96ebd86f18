"""A sparse call's error against exact attention, on the rows the guard samples (``check.samples``).

Two measurements, both without a copy of q, k or v:

* ``output_error``: the relative L2 error of a call's output on the sampled rows against exact
  attention on them (fp32, fp64 for fp64 inputs). What the readout reports is this, for the calls
  that ran sparse.
* ``routed_errors``: for a backend whose output is exact attention over its routed blocks, the error of
  every setting of a calibration ladder at once: the sampled rows' scores are computed once, against
  every key, and each setting's routing masks them. Memory: the scores of at most ``ROW_BYTES`` of rows
  at a time, and for half inputs ``KEY_STEP`` keys or values cast at a time; time: one pass over the
  keys for the scores, then one over the values per setting.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import check as _check
from ..kernels.base import default_scale

#: Scores of the sampled rows held at once by ``routed_errors``.
ROW_BYTES = 8 * 2**20
#: Keys cast (half inputs) or multiplied at once by ``routed_errors``: few, large matrix products.
KEY_STEP = 4096


def _bhsd(t, layout: str):
    return t.transpose(1, 2) if layout == "bshd" else t


def _compute(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _exact_off(device_type: str):
    return torch.autocast(device_type, enabled=False) if device_type in ("cuda", "cpu") else contextlib.nullcontext()


def _times_values(p, v2, compute):
    """``p @ v2`` with v2 cast ``KEY_STEP`` keys at a time (no cast copy of a head's values)."""
    if v2.dtype == compute:
        return p @ v2
    out = torch.zeros((p.shape[0], v2.shape[-1]), dtype=compute, device=p.device)
    for start in range(0, v2.shape[0], KEY_STEP):
        out.addmm_(p[:, start:start + KEY_STEP], v2[start:start + KEY_STEP].to(compute))
    return out


def _exact_rows(q, k, v, scale, samples):
    """For each (b, h) pair and chunk of its sampled rows, in order: (b, h, rows, scores, exact output),
    q, k, v in (b, h, n, d), scores scaled, both in fp32 (fp64 for fp64 inputs)."""
    compute = _compute(q.dtype)
    scale = default_scale(scale, q.shape[-1])
    kv = k.shape[2]
    per_chunk = max(1, ROW_BYTES // (kv * (torch.finfo(compute).bits // 8)))
    rows = samples.rows.to(q.device)
    for b, h in zip(samples.batch.tolist(), samples.head.tolist()):
        k2, v2 = k[b, h], v[b, h]
        for start in range(0, len(rows), per_chunk):
            chunk = rows[start:start + per_chunk]
            q_rows = q[b, h].index_select(0, chunk).to(compute).mul_(scale)
            if k2.dtype == compute:
                scores = q_rows @ k2.T
            else:
                scores = torch.empty((len(chunk), kv), dtype=compute, device=q.device)
                for at in range(0, kv, KEY_STEP):
                    scores[:, at:at + KEY_STEP] = q_rows @ k2[at:at + KEY_STEP].to(compute).T
            yield b, h, chunk, scores, _times_values(torch.softmax(scores, dim=-1), v2, compute)


def output_error(out, q, k, v, scale, layout: str, samples=None) -> float:
    """Relative L2 error of ``out`` on the sampled rows against exact attention; inf when ``out`` is
    non-finite there, nan when exact attention is (non-finite inputs)."""
    q, k, v, out = (_bhsd(t, layout) for t in (q, k, v, out))
    s = samples if samples is not None else _check.samples(q, "bhsd")
    diff = norm = 0.0
    with _exact_off(q.device.type), torch.no_grad():
        for b, h, rows, _, exact in _exact_rows(q, k, v, scale, s):
            got = out[b, h].index_select(0, rows).to(exact.dtype)
            diff += float((got - exact).square().sum())
            norm += float(exact.square().sum())
    if not math.isfinite(norm):
        return math.nan
    return math.sqrt(diff / max(norm, 1e-300)) if math.isfinite(diff) else math.inf


def routed_errors(q, k, v, scale, layout: str, routings: list, samples=None) -> list[float]:
    """The relative L2 error on the sampled rows of attention over each routing's blocks (q, k, v in
    ``layout``), against exact attention: one float per routing."""
    q, k, v = (_bhsd(t, layout) for t in (q, k, v))
    s = samples if samples is not None else _check.samples(q, "bhsd")
    compute = _compute(q.dtype)
    kv = k.shape[2]
    diff = [0.0] * len(routings)
    norm = 0.0
    with _exact_off(q.device.type), torch.no_grad():
        for b, h, rows, scores, exact in _exact_rows(q, k, v, scale, s):
            norm += float(exact.square().sum())
            for i, routing in enumerate(routings):
                probs = torch.softmax(scores.masked_fill(~routing.keeps(b, h, rows, kv), float("-inf")), dim=-1)
                diff[i] += float((_times_values(probs, v[b, h], compute) - exact).square().sum())
    if not math.isfinite(norm):
        return [math.nan] * len(routings)
    return [math.sqrt(d / max(norm, 1e-300)) for d in diff]
