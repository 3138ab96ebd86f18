"""The dtype names the commands accept (``fp16``, ``bfloat16``, ...) and the dtype each model role
runs in when none is given."""
from __future__ import annotations

import torch

DTYPES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
# What the hosts usually run on a GPU: fp16 UNets and VAEs, bf16 DiTs.
GPU_DEFAULT_DTYPE = {"unet": "fp16", "vae": "fp16", "dit": "bf16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    """A name from ``DTYPES`` (any case); ValueError naming the accepted ones otherwise."""
    try:
        return DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}; got {name!r}") from None


def default_dtype(role: str, gpu: bool) -> torch.dtype:
    """float32 off a GPU; on one, what the hosts usually run for ``role`` (``GPU_DEFAULT_DTYPE``)."""
    return parse_dtype(GPU_DEFAULT_DTYPE[role]) if gpu else torch.float32
