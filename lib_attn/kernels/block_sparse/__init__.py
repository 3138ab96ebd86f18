"""The native block-sparse backend: routing from pooled scores (``routing``), run on PyTorch's
FlexAttention compiled (``flex``: torch 2.5 and later, CUDA and CPU) or on a design that needs only
PyTorch (``gather``: every torch this engine supports, every device), which also serves where the
compiler fails (its reason is kept and logged once)."""
from __future__ import annotations

import logging

import torch

from ...spec import FLOATS
from ..base import Status, default_scale, failure_text, is_sticky
from ..sparse import Knob, Routing, SparseBackend, SparseResult
from . import flex, gather
from .routing import route

log = logging.getLogger("lib_attn")
#: Device types whose FlexAttention is compiled (elsewhere it would run eagerly, on the full scores).
FLEX_DEVICES = ("cuda", "cpu")


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

    #: Why compiled FlexAttention failed here (then the gather design serves), or "".
    flex_failed = ""

    def _probe(self) -> Status:
        return Status(True, version=f"torch {torch.__version__}")

    def design(self, device_type: str) -> str:
        """``flex`` or ``gather``: the design that runs on ``device_type``."""
        if flex.available() and device_type in FLEX_DEVICES and not self.flex_failed:
            return "flex"
        return "gather"

    def variant(self, spec) -> str:
        return "FlexAttention" if self.design(spec.device.type) == "flex" else "gather"

    def gives_lse(self, spec) -> bool:
        return self.design(spec.device.type) == "flex" and flex.gives_lse(spec.device.type)

    def routing(self, q, k, scale, knob: Knob) -> Routing:
        with torch.no_grad():
            return route(q, k, default_scale(scale, q.shape[-1]), self.block, knob.name, knob.value)

    def run_sparse(self, q, k, v, scale, knob: Knob) -> SparseResult:
        scale = default_scale(scale, q.shape[-1])
        with torch.no_grad():
            routing = route(q, k, scale, self.block, knob.name, knob.value)
            if self.design(q.device.type) == "flex":
                try:
                    out, lse = flex.run(q, k, v, scale, routing, self.block)
                    return SparseResult(out, lse, routing.kept)
                except Exception as exc:  # noqa: BLE001 - a compiler that fails here: the gather design serves
                    if is_sticky(exc):
                        raise
                    self.flex_failed = failure_text(exc)
                    log.warning("block-sparse: compiled FlexAttention failed here (%s); the gather design serves "
                                "from now on", self.flex_failed)
            out = gather.run(q, k, v, scale, routing, self.block)
        return SparseResult(out, None, routing.kept)
