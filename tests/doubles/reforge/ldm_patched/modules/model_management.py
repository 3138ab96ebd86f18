"""Double of reForge's ldm_patched/modules/model_management.py: the queries attention selection reads.

``--use-sage-attention``/``--use-sage-attention3``/``--use-flash-attention`` are read as given (the
attention module then needs the package); xformers counts when it imports (not ``--disable-xformers``,
not ``--attention-pytorch``); SDPA is on with ``--attention-pytorch`` and on an NVIDIA GPU unless
``--attention-split``/``--attention-quad``.
"""
import importlib.util
import sys
from enum import Enum

import torch

from ldm_patched.modules.args_parser import args


class CPUState(Enum):
    GPU = 0
    CPU = 1
    MPS = 2


cpu_state = CPUState.CPU if args.always_cpu or not torch.cuda.is_available() else CPUState.GPU
OOM_EXCEPTION = torch.cuda.OutOfMemoryError

XFORMERS_IS_AVAILABLE = False
if not args.disable_xformers and importlib.util.find_spec("xformers") is not None:
    import xformers  # noqa: F401
    XFORMERS_IS_AVAILABLE = True
XFORMERS_ENABLED_VAE = True

ENABLE_PYTORCH_ATTENTION = False
if args.attention_pytorch:
    ENABLE_PYTORCH_ATTENTION = True
    XFORMERS_IS_AVAILABLE = False
if cpu_state == CPUState.GPU and torch.version.cuda and not (args.attention_split or args.attention_quad):
    ENABLE_PYTORCH_ATTENTION = True


def is_nvidia():
    return cpu_state == CPUState.GPU and bool(torch.version.cuda)


def is_amd():
    return False


def sage_attention_enabled():
    return args.use_sage_attention


def sage_attention3_enabled():
    return args.use_sage_attention3


def flash_attention_enabled():
    return args.use_flash_attention


def xformers_enabled():
    if sys.modules.get("xformers") is None or cpu_state != CPUState.GPU:
        return False
    return XFORMERS_IS_AVAILABLE


def xformers_enabled_vae():
    return xformers_enabled() and XFORMERS_ENABLED_VAE


def pytorch_attention_enabled():
    return ENABLE_PYTORCH_ATTENTION


def pytorch_attention_enabled_vae():
    return False if is_amd() else pytorch_attention_enabled()


def pytorch_attention_flash_attention():
    return ENABLE_PYTORCH_ATTENTION and is_nvidia()


def force_upcast_attention_dtype():
    return {torch.float16: torch.float32} if args.force_upcast_attention else None


def get_torch_device():
    return torch.device("cpu") if cpu_state == CPUState.CPU else torch.device(torch.cuda.current_device())


def get_free_memory(dev=None, torch_free_too=False):
    free = 16 * 1024 ** 3
    return (free, free) if torch_free_too else free


def soft_empty_cache(force=False):
    pass


def dtype_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()
