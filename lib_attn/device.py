"""What the engine needs to know about a device, read once per device and never at import."""
from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the backends see it. ``capability`` is (major, minor) on CUDA, else None."""

    type: str
    index: int | None = None
    name: str = ""
    capability: tuple[int, int] | None = None
    total_memory: int | None = None

    @property
    def sm(self) -> int | None:
        return None if self.capability is None else self.capability[0] * 10 + self.capability[1]

    @property
    def half_dtype(self) -> torch.dtype:
        """The 16-bit type fp32 inputs are cast to for half-only kernels: bf16 where the GPU has it."""
        if self.type == "cuda" and (self.sm or 0) < 80:
            return torch.float16
        return torch.bfloat16

    def describe(self) -> str:
        if self.type == "cuda":
            return f"{self.name} (sm{self.sm})"
        return self.name or self.type


@lru_cache(maxsize=None)
def _info(device_type: str, index: int | None) -> DeviceInfo:
    if device_type == "cuda":
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo("cuda", index, props.name, (props.major, props.minor), props.total_memory)
    if device_type == "cpu":
        return DeviceInfo("cpu", None, platform.processor() or platform.machine() or "cpu")
    return DeviceInfo(device_type, index, device_type)


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Facts about ``device``; with None, the first CUDA device when there is one, else the CPU.

    Calling this with a CUDA device initialises CUDA, so the engine only does it on a real call.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return _info(device.type, device.index)
