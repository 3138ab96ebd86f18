"""The native block-sparse backend: routing from pooled scores (``routing``), run on PyTorch's
FlexAttention compiled (``flex``: torch 2.5 and later, CUDA and CPU) or on a design that needs only
PyTorch (``gather``: every torch this engine supports, every device), which also serves where the
compiler fails (its reason is kept, per device type, dtype and head dim, and logged once each).

Every key block a query block does not route still counts through one pooled term (its mean key, whose
score is raised by the log of its token count, and its mean value), in both designs: the softmax keeps
the whole sequence's mass, which the routed blocks alone would lose. A joint call's conditioning tokens
(``lib_attn.conditioning``) are key blocks every query block keeps, and their query rows are computed
over every key (``exact``)."""
from __future__ import annotations

import logging

import torch

from ... import conditioning
from ...spec import FLOATS
from ..base import Status, default_scale, failure_text, is_sticky
from ..sparse import Knob, Routing, SparseBackend, SparseResult
from . import exact, flex, gather
from .routing import route, scores

log = logging.getLogger("lib_attn")
#: Device types whose FlexAttention is compiled (elsewhere it would run eagerly, on the full scores).
FLEX_DEVICES = ("cuda", "cpu")
#: Where FlexAttention runs the pooled routing. On a CPU the gather design runs it: PyTorch's C++ lowering
#: (2.13) fails to compile the pooled rows' score modifier once shapes go dynamic, and compiled for fixed
#: shapes (``dynamic=False``) it ran slower than the gather design's second pass (docs/sparse.md).
POOLED_FLEX_DEVICES = ("cuda",)


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

    #: Whether the blocks a query block does not route count through their pooled term.
    pooled = True

    def __init__(self):
        #: Why compiled FlexAttention failed, per (device type, dtype, head dim): the gather design serves those.
        self.flex_failures: dict = {}
        #: The design every call runs when set (the benchmark compares the two).
        self.forced = ""

    def _probe(self) -> Status:
        return Status(True, version=f"torch {torch.__version__}")

    def design(self, device_type: str, dtype=None, head_dim=None) -> str:
        """``flex`` or ``gather``: the design that runs calls on ``device_type`` in ``dtype`` with ``head_dim``."""
        if self.forced:
            return self.forced
        devices = POOLED_FLEX_DEVICES if self.pooled else FLEX_DEVICES
        if flex.available() and device_type in devices and (device_type, dtype, head_dim) not in self.flex_failures:
            return "flex"
        return "gather"

    def variant(self, spec) -> str:
        return "FlexAttention" if self._design_of(spec) == "flex" else "gather"

    def _design_of(self, spec) -> str:
        return self.design(spec.device.type, spec.dtype, spec.head_dim)

    def gives_lse(self, spec) -> bool:
        return self._design_of(spec) == "flex" and flex.gives_lse(spec.device.type)

    def _text(self, q):
        """The blocks holding the call's conditioning tokens (``lib_attn.conditioning``), or None."""
        return conditioning.current_blocks(q.shape[2], self.block)

    def routing(self, q, k, scale, knob: Knob) -> Routing:
        with torch.no_grad():
            return route(q, k, default_scale(scale, q.shape[-1]), self.block, knob.name, knob.value, self.pooled,
                         text=self._text(q))

    def routings(self, q, k, scale, knobs) -> list:
        """``routing`` at each of ``knobs``, from one set of pooled scores."""
        with torch.no_grad():
            scale = default_scale(scale, q.shape[-1])
            s, text = scores(q, k, scale, self.block), self._text(q)
            return [route(q, k, scale, self.block, kn.name, kn.value, self.pooled, s, text) for kn in knobs]

    def run_sparse(self, q, k, v, scale, knob: Knob) -> SparseResult:
        scale = default_scale(scale, q.shape[-1])
        with torch.no_grad():
            routing = route(q, k, scale, self.block, knob.name, knob.value, self.pooled, text=self._text(q))
            where = (q.device.type, q.dtype, q.shape[-1])
            if self.design(*where) == "flex":
                try:
                    out, lse = flex.run(q, k, v, scale, routing, self.block)
                    exact.overwrite(out, lse, q, k, v, scale, routing)
                    return SparseResult(out, lse, routing.kept)
                except Exception as exc:  # noqa: BLE001 - a compiler that fails here: the gather design serves
                    if is_sticky(exc):
                        raise
                    self.flex_failures[where] = failure_text(exc)
                    log.warning("block-sparse: compiled FlexAttention failed on %s %s, head dim %d (%s); the gather "
                                "design serves such calls from now on", where[0], str(where[1]).replace("torch.", ""),
                                where[2], self.flex_failures[where])
            out = gather.run(q, k, v, scale, routing, self.block)
            exact.overwrite(out, None, q, k, v, scale, routing)
        return SparseResult(out, None, routing.kept)
