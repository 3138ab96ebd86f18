"""Double of modules/devices.py (CPU machine; tests may set ``device`` to a CUDA torch.device object)."""
import contextlib

import torch

cpu = torch.device("cpu")
device = device_interrogate = device_gfpgan = device_esrgan = device_codeformer = cpu
dtype = torch.float16
dtype_vae = torch.float16
dtype_unet = torch.float16
unet_needs_upcast = False


def get_optimal_device():
    return cpu


def cond_cast_unet(input):
    return input.to(dtype_unet) if unet_needs_upcast else input


def cond_cast_float(input):
    return input.float() if unet_needs_upcast else input


def torch_gc():
    """Gives the allocator's cached blocks back to the device (CUDA only), as A1111's does."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def autocast(disable=False):
    if disable or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast("cuda")


def without_autocast(disable=False):
    return torch.autocast("cuda", enabled=False) if torch.is_autocast_enabled() and not disable else contextlib.nullcontext()
