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
#: PyTorch's own SDPA, the function torch ships. ``F.scaled_dot_product_attention`` is this very object
#: until a host or extension replaces that global (SD.Next's overrides, "SageAttention as SDPA" patches);
#: torch's C module keeps it whatever ran before this import, and ``sdpa`` always calls this one.
TORCH_SDPA = getattr(torch._C._nn, "scaled_dot_product_attention", None) or getattr(F, "scaled_dot_product_attention", None)


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
#: PyTorch's CPU flash kernel has its own operator from torch 2.2 (returning the output and its
#: log-sum-exp); on torch 2.1 ``FLASH_OP`` serves the CPU too.
CPU_FLASH_OP = _aten("_scaled_dot_product_flash_attention_for_cpu")
#: PyTorch's CPU flash kernel took no mask before torch 2.3 (it ran masked calls on the math kernel).
CPU_FLASH_TAKES_MASK = _schema_has(CPU_FLASH_OP, "attn_mask")

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


# --- ROCm: PyTorch's fused SDPA kernels come from AOTriton ------------------------------------
# Sources: pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (check_flash_attention_hardware_support,
# check_mem_efficient_hardware_support: AOTriton's check_gpu, then isArchExperimentallySupported gated by
# TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL; head_dim <= 256, 512 from AOTriton 0.9); ROCm/aotriton tags
# 0.4b-0.13b (AOTRITON_TARGET_ARCH / TARGET_GPUS, v2src|v3src util.cc isArchExperimentallySupported);
# the pins of PyTorch's releases: 2.3 AOTriton 0.4b (flash only), 2.5 0.7b (+ memory-efficient,
# Navi31 behind the switch), 2.6 0.8b, 2.7 0.9.2b, 2.8 0.10b, 2.9 0.11b, 2.10 0.11.1b, 2.12 0.13b.
# PyTorch's own check on the real call has the last word; these tables describe a GPU without one.

#: gfx architecture -> first torch release whose AOTriton has attention kernels for it.
AOTRITON_FIRST_TORCH = {
    "gfx90a": (2, 3), "gfx942": (2, 3),                      # MI200, MI300
    "gfx1100": (2, 5),                                       # Navi31 (RX 7900)
    "gfx950": (2, 7), "gfx1201": (2, 7),                     # MI350, RX 9070
    "gfx1150": (2, 8), "gfx1151": (2, 8), "gfx1200": (2, 8),
    "gfx1101": (2, 10), "gfx1102": (2, 10), "gfx1103": (2, 10),
    "gfx1152": (2, 11), "gfx1153": (2, 11),
}
#: (first, last or None, archs): torch releases in which PyTorch runs AOTriton on these GPUs only
#: with TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1.
AOTRITON_EXPERIMENTAL = (
    ((2, 5), (2, 6), ("gfx1100",)),
    ((2, 7), (2, 7), ("gfx950", "gfx1201")),
    ((2, 8), (2, 11), ("gfx950", "gfx1151", "gfx1201")),
    ((2, 9), (2, 9), ("gfx1100",)),
    ((2, 12), None, ("gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1152", "gfx1153", "gfx1200")),
)
AOTRITON_SWITCH = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"
#: The memory-efficient kernel on ROCm arrived with AOTriton 0.7b (torch 2.5); flash with 0.4b (2.3).
ROCM_FLASH_FROM = (2, 3)
ROCM_EFFICIENT_FROM = (2, 5)


def aotriton_experimental(arch: str) -> bool:
    """Whether this torch runs AOTriton on ``arch`` only behind the experimental switch."""
    return any(first <= TORCH_VERSION and (last is None or TORCH_VERSION <= last) and arch in archs
               for first, last, archs in AOTRITON_EXPERIMENTAL)


def aotriton_missing(arch: str, kernel: str = "flash") -> str | None:
    """Why this torch has no AOTriton ``kernel`` ("flash" or "efficient") for ``arch``, or None."""
    first = AOTRITON_FIRST_TORCH.get(arch)
    since = max(first or (0, 0), ROCM_FLASH_FROM if kernel == "flash" else ROCM_EFFICIENT_FROM)
    if first is None:
        return f"{arch or 'this AMD GPU'}: no fused attention kernel in this torch build (AOTriton has none for it)"
    if TORCH_VERSION < since:
        return f"{arch}: no fused {kernel} attention kernel before torch {since[0]}.{since[1]} (torch {TORCH_VERSION_TEXT})"
    if aotriton_experimental(arch) and os.environ.get(AOTRITON_SWITCH) != "1":
        return (f"{arch}: torch {TORCH_VERSION_TEXT} keeps its AOTriton attention kernels off on this GPU "
                f"(experimental) unless {AOTRITON_SWITCH}=1 is set")
    return None


def aotriton_max_head_dim() -> int:
    return 512 if TORCH_VERSION >= (2, 7) else 256


# --- when measuring kernels is not allowed (tuning gates) ------------------------------------

def _is_compiling_probe():
    # torch.compiler.is_compiling arrived in 2.3; torch._dynamo.is_compiling is the 2.1-2.2 name. Both
    # answer True while Dynamo traces and False in eager mode.
    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if found is None:
        found = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return found or (lambda: False)


#: Whether the caller is being traced by torch.compile; Dynamo reads it as a constant while tracing.
IS_COMPILING = _is_compiling_probe()


def compiling() -> bool:
    """Whether torch.compile (dynamo) or TorchScript is tracing the current code."""
    return bool(IS_COMPILING() or torch.jit.is_tracing() or torch.jit.is_scripting())


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (recomputation under
    activation checkpointing calls attention there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _stop_recomputation() -> type:
    import torch.utils.checkpoint as ckpt

    class _Never(Exception):
        pass

    return getattr(ckpt, "_StopRecomputationError", _Never)


#: What non-reentrant activation checkpointing raises from inside the call whose saved tensors complete
#: a recomputation (its "early stop"): that call ran, and nothing after it in the recomputed code does.
STOP_RECOMPUTATION = _stop_recomputation()


def capturing(device_type: str) -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    check = getattr(torch.cuda, "is_current_stream_capturing", None)
    return bool(check is not None and check())


def cuda_driver_version() -> int | None:
    """The CUDA driver's API version (e.g. 12080), or None on a build without CUDA."""
    query = getattr(torch._C, "_cuda_getDriverVersion", None)
    if query is None or not torch.cuda.is_available():
        return None
    try:
        return int(query())
    except RuntimeError:
        return None


def autocast_dtype(device_type: str):
    """The dtype autocast computes in on ``device_type`` when it is on there, else None."""
    try:
        if not torch.is_autocast_enabled(device_type):  # torch >= 2.4 takes the device type
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):
        pass
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return None


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


# --- FlexAttention (block-sparse attention from a block mask) ---------------------------------

def _flex():
    """(flex_attention, BlockMask) from torch 2.5, where ``BlockMask.from_kv_blocks`` and compiled
    block skipping on CPU and CUDA arrived; (None, None) before."""
    if TORCH_VERSION < (2, 5):
        return None, None
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None, None
    return flex_attention, BlockMask


FLEX_ATTENTION, FLEX_BLOCK_MASK = _flex()


def _flex_lse_arguments() -> dict:
    """The keyword that makes flex_attention return its log-sum-exp: ``return_aux=AuxRequest(lse=True)``
    where it exists (``return_lse`` is deprecated there), else ``return_lse=True``."""
    if FLEX_ATTENTION is None:
        return {}
    from torch.nn.attention import flex_attention as module

    request = getattr(module, "AuxRequest", None)
    return {"return_aux": request(lse=True)} if request is not None else {"return_lse": True}


FLEX_LSE_ARGUMENTS = _flex_lse_arguments()
#: ``BlockMask.from_kv_blocks`` can skip the transposed (query-side) tables a backward pass needs.
FLEX_SKIPS_Q_BLOCKS = FLEX_BLOCK_MASK is not None and "compute_q_blocks" in inspect.signature(
    FLEX_BLOCK_MASK.from_kv_blocks).parameters
FLEX_TAKES_SEQ_LENGTHS = FLEX_BLOCK_MASK is not None and "seq_lengths" in inspect.signature(
    FLEX_BLOCK_MASK.from_kv_blocks).parameters
