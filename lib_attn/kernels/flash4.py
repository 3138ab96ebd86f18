"""FlashAttention-4 (``flash-attn-4`` on PyPI): CuTe DSL kernels, compiled at run time, for Hopper and Blackwell.

Its module is ``flash_attn.cute`` (no ``flash_attn/__init__.py`` of its own, so it installs beside
FA2). ``flash_attn_func`` returns ``(out, lse)``. From its ``interface.py`` (4.0.0b40): fp16/bf16; on
sm90 head sizes 8-256 in multiples of 8; on sm100/sm110 8-128 in multiples of 8, or 256; on sm120
(consumer Blackwell) an Ampere-style kernel sized for sm120's shared memory, for which the package
checks no head size, so the engine keeps to the sm100 range there. It also has an sm8x path, but the
package targets Hopper and Blackwell, and FA2 serves Ampere and Ada. Each new shape is compiled on its
first call (seconds), so FA4 is never in a default chain: it is used when chosen by name.
"""
from __future__ import annotations

import importlib

from ..spec import NO_MASK, CallSpec
from .base import Backend, Status
from .flash import _version_of

#: Architecture families (sm // 10) FA4 has kernels for that the engine offers it on.
FA4_FAMILIES = {9: "Hopper", 10: "Blackwell", 11: "Blackwell", 12: "consumer Blackwell"}


def fa4_head_dim_reason(head_dim: int, sm: int) -> str:
    """Why FA4 has no kernel for ``head_dim`` on ``sm``, or ''."""
    if head_dim % 8:
        return f"head_dim {head_dim} not a multiple of 8 (FA4)"
    if sm // 10 == 9:
        return "" if 8 <= head_dim <= 256 else f"head_dim {head_dim} not in 8-256 (FA4 on sm90)"
    if 8 <= head_dim <= 128 or (head_dim == 256 and sm // 10 in (10, 11)):
        return ""
    allowed = "8-128 or 256" if sm // 10 in (10, 11) else "8-128"
    return f"head_dim {head_dim} not in {allowed} (FA4 on sm{sm})"


class FlashAttn4(Backend):
    id = "flash-attn-4"
    label = "FlashAttention-4 (flash-attn-4, CuTe DSL)"
    packages = ("flash-attn-4", "nvidia-cutlass-dsl")
    layout = "bshd"
    max_head_dim = 256
    masks = (NO_MASK,)

    def __init__(self):
        self.func = None

    def _probe(self) -> Status:
        self.func = None
        module = importlib.import_module("flash_attn.cute")
        self.func = module.flash_attn_func
        # Its own __version__ reads a distribution named "fa4", which is not the PyPI name.
        return Status(True, version=_version_of(object(), "flash-attn-4"))

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        sm = spec.device.sm or 0
        if sm // 10 not in FA4_FAMILIES:
            return [f"GPU sm{sm}: FA4 targets Hopper (sm90) and Blackwell (sm100, sm103, sm110, sm120, sm121)"]
        why = fa4_head_dim_reason(spec.head_dim, sm)
        return [why] if why else []

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        return [f"{spec.device.arch or 'AMD GPU'}: FA4 has no ROCm build (CuTe DSL, NVIDIA only)"]

    def run(self, q, k, v, mask, scale):
        out = self.func(q, k, v, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out
