"""SageAttention 3: FP4 (microscaled) QK^T and PV on consumer Blackwell, inference only.

Facts from thu-ml/SageAttention's ``sageattention3_blackwell`` (package ``sageattn3``, function
``sageattn3_blackwell``; reForge imports an earlier packaging as ``sageattn.sageattn_blackwell``):

* its CUDA kernel checks for sm120 or sm121 and takes head sizes 64, 128 and 256; for 256 and above
  the Python layer prints a line and runs PyTorch's SDPA instead, so 64 and 128 are the sizes it runs;
* the kernel hub's SageAttention build (``kernels-community/sage-attention``) exports the same function;
* fp16 or bf16, layout (b, h, seq, d), no mask (``attn_mask`` is accepted and not used), and no scale
  argument: the softmax scale is always 1/sqrt(d), so a call with another scale has its queries scaled;
* it subtracts the key mean from the ``k`` it is given, in place: it gets a centred copy of its own;
* sequences are padded to multiples of 128 and quantised in blocks.

Where the engine draws its line: both sequence lengths at least ``MIN_SEQ`` (1024). Below it the
quantisation and padding cost about as much as the attention itself (published: no speedup at
144–472 tokens; on an RTX 5090 SDPA beat it on Wan 1.3B), while FP4 is the least accurate kernel the
engine has: SD's 77-token cross-attention, text encoders and low-resolution UNet levels go to the
next kernel, and the long self-attention of DiTs and video models, where it pays, run on it.
"""
from __future__ import annotations

import importlib
import math

import torch

from ..spec import NO_MASK, CallSpec
from . import hub
from .base import Backend, Status, failure_text, last_dim_contiguous
from .flash import _version_of

SMS = (120, 121)
HEAD_DIMS = (64, 128)
MIN_SEQ = 1024
#: (module, function, distribution) in the order they are looked for.
PACKAGINGS = (("sageattn3", "sageattn3_blackwell", "sageattn3"), ("sageattn", "sageattn_blackwell", "sageattn"))
HUB_FUNCTION = "sageattn3_blackwell"


class Sage3(Backend):
    id = "sage3"
    label = "SageAttention 3 (FP4, Blackwell)"
    packages = tuple(dist for _, _, dist in PACKAGINGS) + ("kernels",)
    approximate = True
    masks = (NO_MASK,)
    backward = False

    def __init__(self):
        self.fn = None

    def _probe(self) -> Status:
        self.fn = None
        errors = []
        for module_name, function, dist in PACKAGINGS:
            try:
                module = importlib.import_module(module_name)
                fn = getattr(module, function)
            except (ImportError, AttributeError) as exc:
                errors.append(failure_text(exc))
                continue
            self.fn = fn
            return Status(True, version=_version_of(module, dist))
        # The kernel hub's SageAttention build carries SageAttention 3's function too.
        module, why = hub.load("sage")
        fn = getattr(module, HUB_FUNCTION, None)
        if fn is None:
            return Status(False, f"{errors[0]}; hub: {why or f'its sage build has no {HUB_FUNCTION}'}")
        self.fn = fn
        return Status(True, version=f"hub {module.hub_source}")

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = []
        if spec.device.sm not in SMS:
            out.append(f"GPU sm{spec.device.sm}: SageAttention 3 runs on sm120/sm121 only")
        if spec.head_dim not in HEAD_DIMS:
            out.append(f"head_dim {spec.head_dim} not in {'/'.join(map(str, HEAD_DIMS))} (SageAttention 3)")
        short = min(spec.q_len, spec.kv_len)
        if short < MIN_SEQ:
            which = "kv_len" if spec.kv_len <= spec.q_len else "q_len"
            out.append(f"{which} {short} < {MIN_SEQ}: SageAttention 3 (FP4) is kept to long sequences, where it pays")
        return out

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        return [f"{spec.device.arch or 'AMD GPU'}: SageAttention 3 has no ROCm build (Blackwell CUDA kernels only)"]

    def run(self, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        d = q.shape[-1]
        if scale is not None and not math.isclose(scale * math.sqrt(d), 1.0, rel_tol=1e-6):
            q = q * (scale * math.sqrt(d))
        k = k - k.mean(dim=2, keepdim=True)
        return self.fn(q, k, v, is_causal=False)
