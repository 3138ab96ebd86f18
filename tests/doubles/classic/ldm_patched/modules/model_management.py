"""Double of Forge Classic's ldm_patched/modules/model_management.py: what attention selection reads.

SageAttention and xformers count when they import (``from sageattention import sageattn``; xformers
with its compiled library), unless ``--disable-sage`` / ``--disable-xformers`` (``--attention-pytorch``
turns xformers off), and are used only on an NVIDIA GPU; SDPA is on with
``--attention-pytorch`` and on an NVIDIA GPU unless ``--attention-split``/``--attention-quad``.
"""
from enum import Enum

import torch

from ldm_patched.modules.args_parser import args


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

ENABLE_PYTORCH_ATTENTION = False
if args.attention_pytorch:
    ENABLE_PYTORCH_ATTENTION = True
    XFORMERS_IS_AVAILABLE = False
if cpu_state == CPUState.GPU and torch.version.cuda and not (args.attention_split or args.attention_quad):
    ENABLE_PYTORCH_ATTENTION = True


def is_nvidia():
    return cpu_state is CPUState.GPU and bool(torch.version.cuda)


def xformers_enabled():
    return cpu_state == CPUState.GPU and XFORMERS_IS_AVAILABLE


def xformers_enabled_vae():
    return xformers_enabled()


def sage_enabled():
    return cpu_state == CPUState.GPU and is_nvidia() and SAGE_IS_AVAILABLE


def pytorch_attention_enabled():
    return ENABLE_PYTORCH_ATTENTION


def pytorch_attention_flash_attention():
    return ENABLE_PYTORCH_ATTENTION and is_nvidia()


def get_free_memory(dev=None, torch_free_too=False):
    free = 16 * 1024 ** 3
    return (free, free) if torch_free_too else free


def dtype_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()
