"""Every torch version gate of the engine, in one place.

Features an old torch lacks become ``None`` or ``False`` here, and the backends turn that into reasons.
Nothing in this module touches CUDA.
"""
from __future__ import annotations

import inspect
import os
import re

import torch
import torch.nn.functional as F


def _version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TORCH_VERSION = _version(torch.__version__)
TORCH_VERSION_TEXT = str(torch.__version__)

#: ``F.scaled_dot_product_attention`` with the ``scale`` keyword (torch 2.1).
HAS_SDPA = hasattr(F, "scaled_dot_product_attention") and TORCH_VERSION >= (2, 1)


def _aten(name: str):
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else getattr(packet, "default", None)


def _schema_has(op, argument: str) -> bool:
    return op is not None and argument in str(op._schema)


#: The SDPA kernels as aten operators, called directly so that one kernel can be pinned per call
#: without entering ``sdpa_kernel`` (a context manager costs more than the whole dispatch budget).
FLASH_OP = _aten("_scaled_dot_product_flash_attention")
EFFICIENT_OP = _aten("_scaled_dot_product_efficient_attention")
CUDNN_OP = _aten("_scaled_dot_product_cudnn_attention")
MATH_OP = _aten("_scaled_dot_product_attention_math")
#: The cuDNN operator took no ``attn_bias`` before torch 2.5.
CUDNN_OP_TAKES_BIAS = _schema_has(CUDNN_OP, "attn_bias")
EFFICIENT_OP_TAKES_BIAS = _schema_has(EFFICIENT_OP, "attn_bias")

#: ``torch._fused_sdp_choice`` answers which kernel F.scaled_dot_product_attention would run.
FUSED_SDP_CHOICE = getattr(torch, "_fused_sdp_choice", None)


def _sdp_backend_values() -> dict[str, int]:
    enum = None
    try:
        from torch.nn.attention import SDPBackend as enum  # torch >= 2.3
    except ImportError:
        enum = getattr(torch.backends.cuda, "SDPBackend", None)
    out: dict[str, int] = {}
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        member = getattr(enum, name, None) if enum is not None else None
        if member is not None:
            out[name] = int(member.value) if hasattr(member, "value") else int(member)
    return out


SDP_BACKEND = _sdp_backend_values()

#: PyTorch's own per-kernel checks; they explain a refusal through warnings when ``debug=True``.
CAN_USE = {
    "flash": getattr(torch.backends.cuda, "can_use_flash_attention", None),
    "efficient": getattr(torch.backends.cuda, "can_use_efficient_attention", None),
    "cudnn": getattr(torch.backends.cuda, "can_use_cudnn_attention", None),
}
SDPA_PARAMS = getattr(torch.backends.cuda, "SDPAParams", None)


def sdpa_params(q, k, v, mask):
    """Build ``SDPAParams``; its constructor gained ``enable_gqa`` in torch 2.5."""
    try:
        return SDPA_PARAMS(q, k, v, mask, 0.0, False, False)
    except TypeError:
        return SDPA_PARAMS(q, k, v, mask, 0.0, False)


def cudnn_sdpa_switched_off() -> str | None:
    """Why this torch keeps its cuDNN attention off, or None when it does not."""
    if TORCH_VERSION < (2, 5) and os.environ.get("TORCH_CUDNN_SDPA_ENABLED") != "1":
        return f"torch {TORCH_VERSION_TEXT} keeps cuDNN attention off unless TORCH_CUDNN_SDPA_ENABLED=1 is set"
    return None


def flash_built() -> bool:
    """Whether this torch build has its CUDA flash kernel (the Windows wheels do not)."""
    probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if probe is None:
        return True  # older torch: unknown here, PyTorch's own per-call check decides
    return bool(probe())


def _is_compiling_probe():
    # torch.compiler.is_compiling arrived in 2.3; torch._dynamo.is_compiling is the 2.1-2.2 name. Both
    # answer True while Dynamo traces and False in eager mode.
    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None:
        found = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return found or (lambda: False)


#: Whether the caller is being traced by torch.compile; Dynamo reads it as a constant while tracing.
IS_COMPILING = _is_compiling_probe()

def _custom_op():
    found = getattr(torch.library, "custom_op", None)
    try:
        return found if found is not None and "schema" in inspect.signature(found).parameters else None
    except (TypeError, ValueError):
        return None


#: ``torch.library.custom_op`` taking a written schema (torch 2.4): the engine becomes one opaque
#: operator under torch.compile. Older torch has no custom_op with a fake implementation; there the
#: engine runs outside the graph.
CUSTOM_OP = _custom_op()
