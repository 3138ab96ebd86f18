"""Double of Forge Neo's backend/memory_management.py: what attention selection reads.

xformers, SageAttention and flash-attn count as available when they import (``from sageattention
import sageattn``, ``from flash_attn import flash_attn_func``; xformers with its compiled library),
unless their ``--disable-*`` flag is given (``--xformers``/``--sage``/``--flash`` only install them);
each is used only on an NVIDIA GPU. ``--attention-pytorch`` turns SDPA on and xformers off; on a GPU SDPA is on
unless ``--attention-split``.
"""
from enum import Enum

import torch

from backend.args import args


class CPUState(Enum):
    GPU = 0
    CPU = 1
    MPS = 2


cpu_state = CPUState.CPU if args.always_cpu or not torch.cuda.is_available() else CPUState.GPU
OOM_EXCEPTION = torch.cuda.OutOfMemoryError


if args.disable_xformers:
    XFORMERS_IS_AVAILABLE = False
else:
    try:
        import xformers
        import xformers.ops  # noqa: F401
        XFORMERS_IS_AVAILABLE = getattr(xformers, "_has_cpp_library", True)
    except Exception:
        XFORMERS_IS_AVAILABLE = False

if args.disable_sage:
    SAGE_IS_AVAILABLE = False
else:
    try:
        from sageattention import sageattn  # noqa: F401
    except ImportError:
        SAGE_IS_AVAILABLE = False
    else:
        SAGE_IS_AVAILABLE = True

if args.disable_flash:
    FLASH_IS_AVAILABLE = False
else:
    try:
        from flash_attn import flash_attn_func  # noqa: F401
    except ImportError:
        FLASH_IS_AVAILABLE = False
    else:
        FLASH_IS_AVAILABLE = True

ENABLE_PYTORCH_ATTENTION = False
if args.attention_pytorch:
    ENABLE_PYTORCH_ATTENTION = True
    XFORMERS_IS_AVAILABLE = False
if cpu_state == CPUState.GPU and not ENABLE_PYTORCH_ATTENTION and not args.attention_split:
    ENABLE_PYTORCH_ATTENTION = True


def is_nvidia():
    return cpu_state == CPUState.GPU and torch.version.cuda is not None


def get_torch_device():
    return torch.device("cpu") if cpu_state == CPUState.CPU else torch.device(torch.cuda.current_device())


def xformers_enabled():
    return cpu_state == CPUState.GPU and XFORMERS_IS_AVAILABLE


def sage_enabled():
    return cpu_state == CPUState.GPU and is_nvidia() and SAGE_IS_AVAILABLE


def flash_enabled():
    return cpu_state == CPUState.GPU and is_nvidia() and FLASH_IS_AVAILABLE


def xformers_enabled_vae():
    return xformers_enabled()


def pytorch_attention_enabled():
    return ENABLE_PYTORCH_ATTENTION


def force_upcast_attention_dtype():
    """{fp16: fp32} under --force-upcast-attention, else None (Neo also upcasts on macOS 14.5+)."""
    return {torch.float16: torch.float32} if args.force_upcast_attention else None


def dtype_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def get_free_memory(dev=None, torch_free_too=False):
    free = 16 * 1024 ** 3
    return (free, free) if torch_free_too else free


#: The models loaded on the device (``LoadedModel``s in the host); a test's model is never placed there.
current_loaded_models = []


def unload_all_models():
    """What a model reload calls first (``forge_model_reload``): every loaded model off the device."""
    current_loaded_models.clear()


def soft_empty_cache(force=False):
    pass
