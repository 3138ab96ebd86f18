"""SageAttention (``sageattn``): quantised QK^T, CUDA, fp16/bf16, head_dim <= 128, never a mask.

``sageattn`` accepts a mask keyword and drops it without a word, so a masked call must not reach it.
1.x is Triton-only and runs from sm70 (fp16); 2.x picks a CUDA kernel per architecture and refuses
the ones it has none for. It has no ROCm build: its kernels are CUDA (and Triton for NVIDIA) only
(thu-ml/SageAttention README, requirements).
"""
from __future__ import annotations

import importlib

import torch

from ..spec import NO_MASK, CallSpec
from .base import Backend, Status, last_dim_contiguous
from .flash import _version_of

#: Architectures SageAttention 2's ``sageattn`` has a kernel for (sm120/121 from its later 2.x releases).
SAGE2_SMS = (80, 86, 89, 90, 120, 121)
#: SageAttention 1.x asserts one of these head sizes.
SAGE1_HEAD_DIMS = (64, 96, 128)


class Sage(Backend):
    id = "sage"
    label = "SageAttention (8-bit QK)"
    approximate = True
    max_head_dim = 128
    masks = (NO_MASK,)
    backward = False

    def __init__(self):
        self.sageattn = None
        self.major = 0

    def _probe(self) -> Status:
        self.sageattn = None
        module = importlib.import_module("sageattention")
        fn = module.sageattn
        version = _version_of(module, "sageattention")
        self.major = int(version.split(".")[0]) if version[:1].isdigit() else 2
        self.sageattn = fn
        return Status(True, version=version)

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        sm = spec.device.sm or 0
        if self.major <= 1:
            out = [f"GPU sm{sm} < sm70"] if sm < 70 else []
            if spec.dtype == torch.bfloat16 and sm < 80:
                out.append(f"bf16 needs sm80, GPU is sm{sm}")
            if spec.head_dim not in SAGE1_HEAD_DIMS:
                out.append(f"head_dim {spec.head_dim} not in {'/'.join(map(str, SAGE1_HEAD_DIMS))} (SageAttention 1)")
            return out
        if sm not in SAGE2_SMS:
            return [f"GPU sm{sm} has no SageAttention {self.major} kernel (sm{', sm'.join(map(str, SAGE2_SMS))})"]
        return []

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        return [f"{spec.device.arch or 'AMD GPU'}: SageAttention has no ROCm build (CUDA kernels only)"]

    def run(self, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        return self.sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale)
