"""What a sparse backend is: a ``Backend`` that computes only part of the scores, steered by one knob.

A sparse backend approximates attention on purpose, so the engine never trusts it by the exact
kernels' bound: it measures each call kind's error against an exact reference and holds it to the
user's budget (``lib_attn.sparse``). To be steered and measured, a sparse backend says more than a
dense one:

* ``knobs``: which routing knobs it takes. ``topk``: the fraction of key blocks each query block
  computes, in (0, 1] (higher: denser, closer to exact). ``threshold``: the method's own threshold,
  whose meaning, range and direction the backend states (``threshold_text``, ``threshold_range``,
  ``threshold_denser``).
* ``ladder(knob)``: the settings calibration may try for a call kind, from ``knob`` (the sparsest the
  user allows) toward denser ones, ending at the densest still worth running sparse.
* ``run_sparse(q, k, v, scale, knob)``: one call at that setting; a ``SparseResult`` with the output,
  the log-sum-exp where ``gives_lse(spec)`` (``returns_lse`` unless the backend says per call; else
  None) and the share of key blocks it computed.
* ``reasons(spec)`` as for every backend: the head dims, dtypes and devices it takes. Whether a call
  may go sparse at all (self-attention, no mask, enough tokens, outside the dense windows) is the
  engine's question, not the backend's (``lib_attn.sparse.eligibility``).

``run(q, k, v, mask, scale)``, the dense entry every backend has, runs at ``default_knob``: a chain
that names a sparse backend like any other gets that setting, checked by the guard as an approximate
kernel. Sparse backends are registered like any other and are never in a default chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import NO_MASK
from .base import Backend

KNOBS = ("topk", "threshold")
#: Keep fractions calibration tries, sparsest first: from the user's ``topk`` upward. Above the last
#: one a sparse kernel computes more than half the scores and gains little over a dense one.
TOPK_LADDER = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


@dataclass(frozen=True)
class Knob:
    """One routing setting: ``name`` in ``KNOBS`` and its value."""

    name: str
    value: float

    @property
    def text(self) -> str:
        return f"{self.name} {self.value:g}"

    def __str__(self) -> str:
        return self.text


@dataclass
class Routing:
    """Which key blocks each query block computes. ``indices``: (b, h, q_blocks, width) key block indices,
    each row's kept blocks first, then (when ``counts`` is given) other blocks it does not keep;
    ``counts``: (b, h, q_blocks) how many of a row's ``width`` entries are kept, or None when all are;
    ``key_blocks``: key blocks in all; ``block``: tokens per block; ``pooled``: every block a row does not
    keep still counts, through one pooled term (its mean key, whose score is raised by the log of its
    token count, and its mean value), so the softmax keeps the whole sequence's mass; ``exact_rows``: the
    query blocks ``[start, stop)`` computed over every key instead (a joint call's conditioning tokens,
    ``lib_attn.conditioning``), or None."""

    indices: torch.Tensor
    counts: torch.Tensor | None
    key_blocks: int
    block: int
    pooled: bool = False
    exact_rows: tuple[int, int] | None = None

    @property
    def kept(self) -> torch.Tensor:
        """The share of (query block, key block) pairs computed, a 0-d tensor (the exact query blocks
        count every key block)."""
        b, h, nq, width = self.indices.shape
        per_row = self.counts if self.counts is not None else torch.full((b, h, nq), width, device=self.indices.device)
        if self.exact_rows is not None:
            start, stop = self.exact_rows
            per_row = per_row.clone()
            per_row[..., start:stop] = self.key_blocks
        return per_row.sum().to(torch.float32) / float(b * h * nq * self.key_blocks)

    def keeps(self, b: int, h: int, rows: torch.Tensor, kv: int) -> torch.Tensor:
        """(len(rows), kv) bool: the keys query ``rows`` of pair (b, h) attend to exactly."""
        return self.kept_blocks(b, h, rows).repeat_interleave(self.block, dim=1)[:, :kv]

    def kept_blocks(self, b: int, h: int, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), key_blocks) bool: the key blocks query ``rows`` of pair (b, h) attend to exactly."""
        q_blocks = (rows // self.block).to(self.indices.device)
        idx = self.indices[b, h].index_select(0, q_blocks)
        keep = torch.zeros((len(rows), self.key_blocks), dtype=torch.bool, device=idx.device)
        if self.counts is None:
            keep.scatter_(1, idx, True)
        else:
            taken = torch.arange(idx.shape[1], device=idx.device) < self.counts[b, h].index_select(0, q_blocks)[:, None]
            keep.scatter_(1, idx, taken)  # a row's entries are distinct blocks: the kept ones, then others
        if self.exact_rows is not None:
            start, stop = self.exact_rows
            keep[(q_blocks >= start) & (q_blocks < stop)] = True
        return keep


@dataclass
class SparseResult:
    """One sparse call's result. ``out``: as ``run`` returns it (the backend's layout, the input dtype);
    ``lse``: (b, h, q_len) natural-log log-sum-exp of the scores it computed, fp32 (fp64 for fp64
    inputs), or None; ``kept``: the share of (query block, key block) pairs computed, in [0, 1], a float
    or a 0-d tensor (read on the host only when the engine samples the call), or a function returning
    one (called only then: a share that costs a pass over q and k)."""

    out: torch.Tensor
    lse: torch.Tensor | None
    kept: object

    def share(self) -> float:
        """``kept`` as a float (nan when the backend gives none)."""
        kept = self.kept() if callable(self.kept) else self.kept
        return float(kept) if kept is not None else float("nan")


class SparseBackend(Backend):
    """Base class of the sparse backends (see the module's docstring).

    ``block``: tokens per routing block (queries and keys); ``returns_lse``: whether ``run_sparse``
    returns the log-sum-exp (context parallelism's ring steps need it; without it, Ulysses only).
    """

    approximate = True
    sparse = True
    masks = (NO_MASK,)
    backward = False
    devices = ("cuda", "cpu", "mps", "xpu")
    block = 128
    returns_lse = False
    knobs: tuple[str, ...] = ("topk",)
    default_knob = Knob("topk", 0.2)
    #: What ``threshold`` means for this backend, its valid range (inclusive) and whether a higher
    #: value is denser (True) or sparser (False). Unused when ``threshold`` is not in ``knobs``.
    threshold_text = ""
    threshold_range: tuple[float, float] = (0.0, 1.0)
    threshold_denser = True
    #: Threshold values calibration tries, from sparsest to densest (when ``threshold`` is a knob).
    threshold_ladder: tuple[float, ...] = ()

    def ladder(self, knob: Knob) -> tuple[Knob, ...]:
        """``knob`` first, then the denser settings of its kind calibration may try, densest last."""
        if knob.name == "topk":
            values = [x for x in TOPK_LADDER if x > knob.value]
        else:
            steps = self.threshold_ladder if self.threshold_denser else tuple(reversed(self.threshold_ladder))
            denser = (lambda x: x > knob.value) if self.threshold_denser else (lambda x: x < knob.value)
            values = [x for x in steps if denser(x)]
        return (knob,) + tuple(Knob(knob.name, x) for x in values)

    def gives_lse(self, spec) -> bool:
        """Whether ``run_sparse`` returns the log-sum-exp for calls like ``spec`` (ring steps need it)."""
        return self.returns_lse

    def threshold_problem(self, value: float) -> str:
        """Why ``value`` is no threshold for this backend ("" when it is one)."""
        if "threshold" not in self.knobs:
            return f"{self.id} routes by topk only (a keep fraction), not by a threshold"
        lo, hi = self.threshold_range
        if not lo <= value <= hi:
            return f"threshold {value:g} is outside {self.id}'s range {lo:g}-{hi:g} ({self.threshold_text})"
        return ""

    def run_sparse(self, q, k, v, scale, knob: Knob) -> SparseResult:
        raise NotImplementedError

    def routing(self, q, k, scale, knob: Knob) -> Routing | None:
        """The routing ``run_sparse`` would use at ``knob`` (q, k in (b, h, n, d)) when its output is exact
        attention over the routed blocks, else None. With it, calibration measures every setting of the
        ladder on the sampled rows from one set of exact scores, without running the kernel."""
        return None

    def routings(self, q, k, scale, knobs) -> list | None:
        """``routing`` at each of ``knobs`` (a backend may share work between them), or None."""
        first = self.routing(q, k, scale, knobs[0])
        if first is None:
            return None
        return [first] + [self.routing(q, k, scale, knob) for knob in knobs[1:]]

    @property
    def states_routing(self) -> bool:
        """Whether ``routing`` may give one: calibration prepares q and k for it only then."""
        return type(self).routing is not SparseBackend.routing

    def run(self, q, k, v, mask, scale):
        if mask is not None:
            raise NotImplementedError(f"{self.id} takes no mask")
        return self.run_sparse(q, k, v, scale, self.default_knob).out


def is_sparse(backend) -> bool:
    return isinstance(backend, SparseBackend)
