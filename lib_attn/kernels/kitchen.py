"""comfy-kitchen (``comfy-kitchen`` on PyPI, ComfyUI's kernel library): loading it once, and its dense INT8 attention.

ComfyUI 0.19 and later list ``comfy-kitchen`` in their requirements, so its users have it installed.
Facts from the released Python of 0.2.40 (``comfy_kitchen/sage_attention.py``, ``backends/cuda``):

* ``comfy_kitchen.sage_attention.int8_attention(q, k, v, *, scale=None, attn_mask=None)`` is a dense
  attention with INT8 Q, K, V and an unsigned INT8 P (softmax arithmetic in fp32), layout
  (b, h, seq, d). It is what ComfyUI's ``--use-ck-attention`` runs. Its ``is_available`` asks for the
  compiled CUDA extension on sm75 or newer (or the HIP extension on an AMD GPU with matrix cores);
  ``_validate_inputs`` takes fp32/fp16/bf16 with one dtype for q, k and v, head sizes 1-256 (padded
  to 64, 128 or 256 inside), unit stride along head_dim, grouped heads, q and kv of any lengths, and a
  bool or float mask broadcastable to (b, h, q, kv). fp32 inputs come back through a bf16 output.
* The package imports on a machine without a GPU; its extension module loads there too (the kernels
  run only on a GPU). ``backends.cuda._EXT_AVAILABLE`` says whether the extension loaded and
  ``_EXT_ERROR`` why not.

What the engine offers of it: ``ck-int8``, an approximate backend like SageAttention (never in a
default chain, checked against the approximate bound), for fp16/bf16 (an fp32 call is cast by the
fp32 policy: the kernel's own fp32 path rounds its output to bf16) and calls without a mask (its
mask arithmetic cannot be checked without the GPU kernel; masked calls go to the next kernel).
"""
from __future__ import annotations

import importlib

from ..spec import NO_MASK, CallSpec
from .base import Backend, Status, last_dim_contiguous
from .flash import _version_of

DIST = "comfy-kitchen"
#: ``is_available``'s minimum compute capability for the INT8 kernel (``_NATIVE_MINIMUM_CAPABILITY``).
INT8_MIN_SM = 75
#: The kernel's widest head: 64, 128 and 256 wide tiles, smaller heads padded up.
INT8_MAX_HEAD_DIM = 256
#: AMD architectures with the matrix cores comfy-kitchen's HIP INT8 kernel asks for (RDNA3 and newer).
MATRIX_CORE_ARCHS = ("gfx11", "gfx12")


def load():
    """(package, version, extension_error): ``comfy_kitchen`` imported, its version, and why its
    compiled extension did not load ("" when it did). ImportError propagates to the probe."""
    package = importlib.import_module("comfy_kitchen")
    version = _version_of(package, DIST)
    cuda = importlib.import_module("comfy_kitchen.backends.cuda")
    error = "" if getattr(cuda, "_EXT_AVAILABLE", False) else str(getattr(cuda, "_EXT_ERROR", "") or "not loaded")
    return package, version, error


class CkInt8(Backend):
    """comfy-kitchen's dense INT8 attention (``sage_attention.int8_attention``)."""

    id = "ck-int8"
    label = "comfy-kitchen INT8 attention (INT8 Q/K/V and P; ComfyUI's --use-ck-attention)"
    packages = (DIST,)
    approximate = True
    min_sm = INT8_MIN_SM
    max_head_dim = INT8_MAX_HEAD_DIM
    masks = (NO_MASK,)
    backward = False

    def __init__(self):
        self.fn = None

    def _probe(self) -> Status:
        self.fn = None
        _, version, error = load()
        module = importlib.import_module("comfy_kitchen.sage_attention")
        fn = getattr(module, "int8_attention", None)
        if fn is None:
            return Status(False, f"comfy-kitchen {version} has no sage_attention.int8_attention (0.2.40 has)", version)
        if error:
            return Status(False, f"comfy-kitchen {version}: its compiled extension did not load ({error})", version)
        self.fn = fn
        return Status(True, version=version)

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        arch = spec.device.arch or "AMD GPU"
        if not arch.startswith(MATRIX_CORE_ARCHS):
            return [f"{arch}: comfy-kitchen's INT8 attention on AMD needs matrix cores (RDNA3 or newer: gfx11xx, "
                    f"gfx12xx)"]
        return []

    def run(self, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        return self.fn(q, k, v, scale=scale)
