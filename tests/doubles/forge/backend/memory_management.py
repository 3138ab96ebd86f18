"""Double of Forge's backend/memory_management.py: the feature queries attention selection reads (B2, B5)."""
import platform
from enum import Enum

import torch

from backend.args import args


class CPUState(Enum):
    GPU = 0
    CPU = 1
    MPS = 2


cpu_state = CPUState.CPU if args.always_cpu or not torch.cuda.is_available() else CPUState.GPU
OOM_EXCEPTION = torch.cuda.OutOfMemoryError

try:
    import xformers  # noqa: F401
    XFORMERS_IS_AVAILABLE = not args.disable_xformers and not args.attention_pytorch
except ImportError:
    XFORMERS_IS_AVAILABLE = False

ENABLE_PYTORCH_ATTENTION = args.attention_pytorch or (
    cpu_state == CPUState.GPU and not (args.attention_split or args.attention_quad))


def get_torch_device():
    return torch.device("cpu") if cpu_state == CPUState.CPU else torch.device(torch.cuda.current_device())


def xformers_enabled():
    return cpu_state == CPUState.GPU and XFORMERS_IS_AVAILABLE


def xformers_enabled_vae():
    return xformers_enabled()


def pytorch_attention_enabled():
    return ENABLE_PYTORCH_ATTENTION


def force_upcast_attention_dtype():
    upcast = args.force_upcast_attention
    if platform.system() == "Darwin" and platform.mac_ver()[0] in ("14.5",):
        upcast = True
    return torch.float32 if upcast else None


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


def get_computation_dtype(device=None, parameters=0, supported_dtypes=(torch.bfloat16, torch.float16, torch.float32)):
    return torch.float32 if cpu_state == CPUState.CPU else supported_dtypes[0]
