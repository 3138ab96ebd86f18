"""The native block-sparse backend: routing from pooled scores (``routing``), run on a design that
needs only PyTorch (``gather``), on every device PyTorch runs on."""
from __future__ import annotations

import torch

from ...spec import FLOATS
from ..base import Status, default_scale
from ..sparse import Knob, Routing, SparseBackend, SparseResult
from . import gather
from .routing import route


class BlockSparse(SparseBackend):
    id = "block-sparse"
    label = "Block-sparse attention (pooled routing, plain PyTorch)"
    dtypes = FLOATS
    block = 128
    knobs = ("topk", "threshold")
    default_knob = Knob("topk", 0.2)
    threshold_text = "the share of a query block's pooled attention mass its kept key blocks cover; higher is denser"
    threshold_range = (0.05, 1.0)
    threshold_denser = True
    threshold_ladder = (0.8, 0.9, 0.95, 0.98, 0.99)

    def _probe(self) -> Status:
        return Status(True, version=f"torch {torch.__version__}")

    def variant(self, spec) -> str:
        return "gather"

    def routing(self, q, k, scale, knob: Knob) -> Routing:
        with torch.no_grad():
            return route(q, k, default_scale(scale, q.shape[-1]), self.block, knob.name, knob.value)

    def run_sparse(self, q, k, v, scale, knob: Knob) -> SparseResult:
        scale = default_scale(scale, q.shape[-1])
        with torch.no_grad():
            routing = route(q, k, scale, self.block, knob.name, knob.value)
            out = gather.run(q, k, v, scale, routing, self.block)
        return SparseResult(out, None, routing.kept)
