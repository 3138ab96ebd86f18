"""Double of ComfyUI's comfy/model_management.py: the queries attention selection reads, as decided on a
CPU (``--cpu``, or no CUDA): no xformers, no SDPA unless ``--use-pytorch-cross-attention``."""
import importlib.util
from enum import Enum

import torch

from comfy.cli_args import args


class CPUState(Enum):
    GPU = 0
    CPU = 1
    MPS = 2


cpu_state = CPUState.CPU if args.cpu or not torch.cuda.is_available() else CPUState.GPU
OOM_EXCEPTION = torch.cuda.OutOfMemoryError

XFORMERS_IS_AVAILABLE = not args.disable_xformers and importlib.util.find_spec("xformers") is not None
ENABLE_PYTORCH_ATTENTION = bool(args.use_pytorch_cross_attention)
if ENABLE_PYTORCH_ATTENTION:
    XFORMERS_IS_AVAILABLE = False
if cpu_state == CPUState.GPU and torch.version.cuda and not (args.use_split_cross_attention or args.use_quad_cross_attention):
    ENABLE_PYTORCH_ATTENTION = True


def is_nvidia():
    return cpu_state == CPUState.GPU and bool(torch.version.cuda)


def xformers_enabled():
    return cpu_state == CPUState.GPU and XFORMERS_IS_AVAILABLE


def xformers_enabled_vae():
    return xformers_enabled()


def pytorch_attention_enabled():
    return ENABLE_PYTORCH_ATTENTION


def pytorch_attention_enabled_vae():
    return pytorch_attention_enabled()


def sage_attention_enabled():
    return args.use_sage_attention


def flash_attention_enabled():
    return args.use_flash_attention


def force_upcast_attention_dtype():
    return {torch.float16: torch.float32} if args.force_upcast_attention else None


def get_free_memory(dev=None, torch_free_too=False):
    free = 16 * 1024 ** 3
    return (free, free) if torch_free_too else free


def get_torch_device():
    return torch.device("cpu") if cpu_state == CPUState.CPU else torch.device(torch.cuda.current_device())
