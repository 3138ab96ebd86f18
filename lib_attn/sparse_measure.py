"""A sparse call's error against exact attention, on sampled query rows.

The rows (``draw``) change from one measurement to the next: at most ``check.PAIRS`` (batch, head) pairs,
drawn at random when the call has more, and in each pair about ``check.SAMPLES / pairs`` rows
(``CALIBRATION_ROWS / pairs`` for a calibration), one drawn at random in each of as many equal
stretches of the sequence. Every row of the call is equally likely
to be measured, so the error measured is an unbiased sample of the whole output's, and every query
block is measured over a kind's measurements, not only fixed rows (a frame's corners, say).

Two measurements, both without a copy of q, k or v:

* ``output_error``: the relative L2 error of a call's output on the sampled rows against exact
  attention on them (fp32, fp64 for fp64 inputs). What the readout reports is this, for the calls
  that ran sparse.
* ``routed_errors``: for a backend whose output is exact attention over its routed blocks, the error of
  every setting of a calibration ladder at once: the sampled rows' scores are computed once, against
  every key, and split by key block (``_BlockSums``), from which each setting's output is a weighted
  sum. Memory: the scores of at most ``ROW_BYTES`` of rows at a time, twice, and their values per key
  block (the scores' size times head dim / block), and ``KEY_STEP`` keys at a time: their keys and values
  cast (half inputs) and the rows' weighted values; time: one pass over the keys for the scores and one
  over the values, then (rows x blocks x head dim) per setting.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import _compat
from . import check as _check
from .kernels.base import default_scale

#: Rows a calibration measures. A sparse output's error is spread unevenly over its rows (on local
#: video-like inputs at top-k 0.25, 1% of the rows hold 40-50% of the squared error), so a few hundred
#: rows read it loosely: for a true 0.045 (15,360 tokens, 4 heads), the 95% bound over 40 draws of 512
#: rows ran 0.035-0.110, of 4,096 rows 0.043-0.057, and a budget of 0.06 took top-k 0.3 in 28% of the
#: draws where 4,096 rows took 0.25 in all. A calibration is made once per kind; the calls measured
#: later (``check.SAMPLES`` rows) only watch it.
CALIBRATION_ROWS = 4096
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


def draw(q, layout: str, rng, rows: int | None = None) -> _check.Samples:
    """The rows one measurement looks at for a call whose queries are ``q`` (in ``layout``), drawn with
    ``rng`` (a ``random.Random``), about ``rows`` in all (default ``check.SAMPLES``; calibration's
    ``CALIBRATION_ROWS``): ``rows`` is (pairs, rows per pair), each pair its own rows."""
    b, h, n = _bhsd(q, layout).shape[:3]
    total = b * h
    pairs = sorted(rng.sample(range(total), _check.PAIRS)) if total > _check.PAIRS else list(range(total))
    pairs = torch.tensor(pairs, dtype=torch.long)
    m = min(n, max(1, (rows or _check.SAMPLES) // len(pairs)))
    edges = torch.div(torch.arange(m + 1) * n, m, rounding_mode="floor")
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    jitter = torch.rand((len(pairs), m), generator=gen, dtype=torch.float64)
    rows = edges[:-1] + (jitter * (edges[1:] - edges[:-1])).long().clamp_(max=n - 1)
    return _check.Samples(pairs // h, pairs % h, rows.clamp_(max=n - 1))


def _pair_rows(samples, i: int):
    """The rows of the ``i``-th pair: a 2-D ``rows`` holds each pair's own, a 1-D one is shared."""
    return samples.rows[i] if samples.rows.dim() == 2 else samples.rows


def _scored_rows(q, k, scale, samples):
    """For each (b, h) pair and chunk of its sampled rows, in order: (b, h, rows, scores), q and k in
    (b, h, n, d), the scores scaled, in fp32 (fp64 for fp64 inputs)."""
    compute = _compute(q.dtype)
    scale = default_scale(scale, q.shape[-1])
    kv = k.shape[2]
    per_chunk = max(1, ROW_BYTES // (kv * (torch.finfo(compute).bits // 8)))
    for i, (b, h) in enumerate(zip(samples.batch.tolist(), samples.head.tolist())):
        rows = _pair_rows(samples, i).to(q.device)
        k2 = k[b, h]
        for start in range(0, len(rows), per_chunk):
            chunk = rows[start:start + per_chunk]
            q_rows = q[b, h].index_select(0, chunk).to(compute).mul_(scale)
            if k2.dtype == compute:
                scores = q_rows @ k2.T
            else:
                scores = torch.empty((len(chunk), kv), dtype=compute, device=q.device)
                for at in range(0, kv, KEY_STEP):
                    scores[:, at:at + KEY_STEP] = q_rows @ k2[at:at + KEY_STEP].to(compute).T
            yield b, h, chunk, scores
            del scores  # the caller's are the only ones: gone before the next chunk's are computed


#: One-sided z of the bound calibration holds a setting to (``bound=True``): the error on the drawn
#: rows plus 1.645 standard errors of that estimate (the normal approximation's 95%: rows differ, and an
#: error concentrated in a few rows makes a small sample read low). Where a few rows hold much of the
#: error the sample's own spread misses them too, and the bound holds less often: on local video-like
#: inputs it fell below the whole output's error in 9-14% of draws of 4,096 rows, by at most 7% at top-k
#: 0.1-0.25 (docs/sparse.md, "First call of a kind").
BOUND_Z = 1.645


def _error(diffs: list, norms: list, bound: bool) -> float:
    """The relative L2 error from per-row squared errors and squared norms (or its upper bound, see
    ``BOUND_Z``); inf when the output is non-finite, nan when exact attention is."""
    d, n = torch.cat(diffs).double(), torch.cat(norms).double()
    sd, sn = float(d.sum()), float(n.sum())
    if not math.isfinite(sn):
        return math.nan
    if not math.isfinite(sd):
        return math.inf
    ratio = sd / max(sn, 1e-300)
    m = len(d)
    if bound and m > 1:  # the ratio estimator's standard error, rows as draws
        ratio += BOUND_Z * math.sqrt(float((d - ratio * n).square().sum()) * m / (m - 1)) / max(sn, 1e-300)
    return math.sqrt(ratio)


def output_error(out, q, k, v, scale, layout: str, samples=None, bound: bool = False) -> float:
    """Relative L2 error of ``out`` on the sampled rows against exact attention (``bound``: its upper
    bound); inf when ``out`` is non-finite there, nan when exact attention is (non-finite inputs)."""
    return output_errors(out, q, k, v, scale, layout, samples)[1 if bound else 0]


def output_errors(out, q, k, v, scale, layout: str, samples=None) -> tuple[float, float]:
    """``output_error`` and its upper bound, from one pass over the sampled rows."""
    q, k, v, out = (_bhsd(t, layout) for t in (q, k, v, out))
    s = samples if samples is not None else _check.samples(q, "bhsd")
    diffs, norms = [], []
    with _exact_off(q.device.type), torch.no_grad():
        for b, h, rows, scores in _scored_rows(q, k, scale, s):
            exact = _times_values(torch.softmax(scores, dim=-1), v[b, h], _compute(q.dtype))
            got = out[b, h].index_select(0, rows).to(exact.dtype)
            diffs.append((got - exact).square().sum(-1))
            norms.append(exact.square().sum(-1))
    return _error(diffs, norms, False), _error(diffs, norms, True)


def _block_means(x, block: int, compute) -> torch.Tensor:
    """(n, d) -> (blocks, d) means in ``compute``, the last block over its own rows."""
    n = x.shape[0]
    full = n // block
    parts = [x[:full * block].to(compute).unflatten(0, (full, block)).mean(1)] if full else []
    if n % block:
        parts.append(x[full * block:].to(compute).mean(0, keepdim=True))
    return torch.cat(parts)


def _per_row(w, weighted):
    """(r, blocks) weights times (r, blocks, d) -> (r, d)."""
    return torch.bmm(w.unsqueeze(1), weighted).squeeze(1)


class _BlockSums:
    """The sampled rows' attention split by key block, from their exact scores (r, kv): per row and
    block the largest score ``top``, ``mass`` the sum of exp(score - top) over the block, ``weighted``
    the values weighted the same way (r, blocks, d), and ``pooled`` the block's mean score plus the log
    of its token count (the pooled term's score). Any routing's output on the rows is a weighted sum of
    these, so every setting of a ladder costs (rows x blocks x d) once the one pass over the keys is
    made, where masking the scores anew would cost (rows x keys x d) per setting."""

    def __init__(self, scores, v2, block: int, compute):
        r, kv = scores.shape
        nk = -(-kv // block)
        padded = torch.nn.functional.pad(scores, (0, nk * block - kv), value=float("-inf")).unflatten(1, (nk, block))
        sizes = torch.full((nk,), float(block), dtype=compute, device=scores.device)
        sizes[-1] = kv - (nk - 1) * block
        self.pooled = _block_means(scores.T, block, compute).T + sizes.log()
        self.top = padded.amax(-1)
        p = padded.sub_(self.top[..., None]).exp_().transpose(0, 1)  # (blocks, r, block); the padding's 0
        self.mass = p.sum(-1).T
        # one batched product per group of blocks, each block's values cast once and laid out per row for
        # the settings' (1 x blocks) @ (blocks x d) products; the blocks' mean values (the pooled term's)
        # from the same cast
        d = v2.shape[-1]
        self.weighted = torch.empty((r, nk, d), dtype=compute, device=scores.device)
        self.v_means = torch.empty((nk, d), dtype=compute, device=scores.device)
        step = max(1, KEY_STEP // block)
        for at in range(0, nk, step):
            values = v2[at * block:(at + step) * block].to(compute)
            if values.shape[0] < min(step, nk - at) * block:  # the last block's missing rows weigh 0
                values = torch.nn.functional.pad(values, (0, 0, 0, min(step, nk - at) * block - values.shape[0]))
            values = values.unflatten(0, (-1, block))
            self.v_means[at:at + step] = values.sum(1) / sizes[at:at + step, None]
            self.weighted[:, at:at + step] = torch.bmm(p[at:at + step], values).transpose(0, 1)

    def exact(self):
        """Exact attention on the rows."""
        w = (self.top - self.top.amax(-1, keepdim=True)).exp()
        return _per_row(w, self.weighted) / (w * self.mass).sum(-1, keepdim=True)

    def routed(self, keep_blocks, pooled: bool):
        """Attention of the rows over the key blocks they keep (``keep_blocks`` (r, blocks) bool), and
        with ``pooled`` every other block through its pooled term."""
        kept = self.top.masked_fill(~keep_blocks, float("-inf"))
        ref = kept.amax(-1, keepdim=True)
        if pooled:
            rest = self.pooled.masked_fill(keep_blocks, float("-inf"))
            ref = torch.maximum(ref, rest.amax(-1, keepdim=True))
        w = (kept - ref).exp()
        out = _per_row(w, self.weighted)
        total = (w * self.mass).sum(-1, keepdim=True)
        if pooled:
            w_rest = (rest - ref).exp()
            out = out + w_rest @ self.v_means
            total = total + w_rest.sum(-1, keepdim=True)
        return out / total


def _as_called(device_type: str, dtype):
    """The caller's autocast (``dtype``, or None when it was off) again, inside ``_exact_off``."""
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def routed_errors(q, k, v, scale, layout: str, routings, samples=None, bound: bool = False) -> list[float] | None:
    """The relative L2 error on the sampled rows of attention over each routing's blocks (with the pooled
    term where the routing has one), q, k, v in ``layout``, against exact attention: one float per
    routing (``bound``: its upper bound, see ``BOUND_Z``). ``routings``: the routings of the whole call,
    or a function of a (batch item, head) pair giving that pair's alone (indexed as pair (0, 0)), made
    only for the pairs drawn, one at a time, under the caller's autocast as the kernel's own routing is
    made (autocast computes its pooled scores in half precision), and None where the backend states no
    routing for the call: then None. The routings share one block size."""
    q, k, v = (_bhsd(t, layout) for t in (q, k, v))
    s = samples if samples is not None else _check.samples(q, "bhsd")
    compute = _compute(q.dtype)
    per_pair = callable(routings)
    called = _compat.autocast_dtype(q.device.type)
    diffs, norms, pair = None, [], None
    with _exact_off(q.device.type), torch.no_grad():
        for b, h, rows, scores in _scored_rows(q, k, scale, s):
            if (b, h) != pair:
                if per_pair:
                    with _as_called(q.device.type, called):
                        current = routings(b, h)
                    if current is None:
                        return None
                else:
                    current = routings
                pair = (b, h)
                at = (0, 0) if per_pair else pair
                block = current[0].block
                if any(r.block != block for r in current):
                    raise ValueError(f"routings of block sizes {sorted({r.block for r in current})}: measured "
                                     "together they share one")
                diffs = diffs or [[] for _ in current]
            sums = _BlockSums(scores, v[b, h], block, compute)
            del scores
            exact = sums.exact()
            norms.append(exact.square().sum(-1))
            for i, routing in enumerate(current):
                got = sums.routed(routing.kept_blocks(*at, rows), routing.pooled)
                diffs[i].append((got - exact).square().sum(-1))
            del sums  # before the next chunk's scores
    return [_error(d, norms, bound) for d in diffs]
