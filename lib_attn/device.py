"""What the engine needs to know about a device, read once per device and never at import.

A ROCm build of torch reports an AMD GPU as device type ``cuda`` with a "capability" that is not an
NVIDIA one (MI300X: (9, 4)); ``platform`` tells the two apart, and ``arch`` names the AMD GPU as
ROCm does (``gcnArchName`` without its feature suffixes, e.g. ``gfx942`` from
``gfx942:sramecc+:xnack-``).
"""
from __future__ import annotations

import platform as _platform
from dataclasses import dataclass
from functools import lru_cache

import torch

PLATFORMS = ("cuda", "rocm", "mps", "xpu", "cpu")

#: AMD architectures with bf16 matrix instructions: CDNA2/3 (MI200, MI300, MI350) and RDNA3/4.
_ROCM_BF16_PREFIXES = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
#: PyTorch's MPS backend takes bfloat16 from macOS 14 (MPSGraph gained the type there).
MPS_BF16_MACOS = (14, 0)


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the backends see it. ``capability`` is (major, minor) as torch reports it on a
    CUDA-type device, else None. ``platform``: cuda (NVIDIA), rocm, mps, xpu or cpu (from ``type``
    when not given); ``arch``: the gfx architecture on ROCm; ``hip``: torch's HIP version;
    ``miopen``: the MIOpen version (what ``torch.backends.cudnn.version()`` reports on ROCm);
    ``macos``: (major, minor) of macOS on MPS."""

    type: str
    index: int | None = None
    name: str = ""
    capability: tuple[int, int] | None = None
    total_memory: int | None = None
    platform: str = ""
    arch: str = ""
    hip: str | None = None
    miopen: int | None = None
    macos: tuple[int, int] | None = None

    def __post_init__(self):
        if not self.platform:
            object.__setattr__(self, "platform", self.type)

    @property
    def sm(self) -> int | None:
        """The NVIDIA compute capability as one number (86 for 8.6); None off NVIDIA."""
        if self.capability is None or self.platform != "cuda":
            return None
        return self.capability[0] * 10 + self.capability[1]

    @property
    def half_dtype(self) -> torch.dtype:
        """The 16-bit type fp32 inputs are cast to for half-only kernels: bf16 where the device has it."""
        if self.platform == "rocm":
            return torch.bfloat16 if self.arch.startswith(_ROCM_BF16_PREFIXES) else torch.float16
        if self.platform == "mps":
            return torch.bfloat16 if (self.macos or (0, 0)) >= MPS_BF16_MACOS else torch.float16
        if self.type == "cuda" and (self.sm or 0) < 80:
            return torch.float16
        return torch.bfloat16

    def describe(self) -> str:
        if self.platform == "rocm":
            return f"{self.name} ({self.arch or 'gfx?'}, ROCm)"
        if self.type == "cuda":
            return f"{self.name} (sm{self.sm})"
        return self.name or self.type


def miopen_text(version: int | None) -> str:
    """MIOpen's version as ``torch.backends.cudnn.version()`` reports it on ROCm (major * 1000000 +
    minor * 1000 + patch, torch/csrc/cuda/shared/cudnn.cpp) -> "3.2.0"."""
    return "-" if version is None else f"{version // 1000000}.{version // 1000 % 1000}.{version % 1000}"


def rocm_arch(gcn_arch_name: str) -> str:
    """``gfx90a:sramecc+:xnack-`` -> ``gfx90a``."""
    return (gcn_arch_name or "").split(":")[0].strip()


def _macos_version() -> tuple[int, int] | None:
    release = _platform.mac_ver()[0]
    if not release:
        return None
    parts = (release.split(".") + ["0"])[:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _miopen_version() -> int | None:
    try:
        return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError:
        return None


@lru_cache(maxsize=None)
def _info(device_type: str, index: int | None) -> DeviceInfo:
    if device_type == "cuda":
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        hip = getattr(torch.version, "hip", None)
        if hip:
            return DeviceInfo("cuda", index, props.name, (props.major, props.minor), props.total_memory,
                              platform="rocm", arch=rocm_arch(getattr(props, "gcnArchName", "")),
                              hip=str(hip), miopen=_miopen_version())
        return DeviceInfo("cuda", index, props.name, (props.major, props.minor), props.total_memory)
    if device_type == "cpu":
        return DeviceInfo("cpu", None, _platform.processor() or _platform.machine() or "cpu")
    if device_type == "mps":
        recommended = getattr(getattr(torch, "mps", None), "recommended_max_memory", None)  # torch 2.5+
        return DeviceInfo("mps", index, "Apple GPU", total_memory=recommended() if recommended else None,
                          macos=_macos_version())
    return DeviceInfo(device_type, index, device_type)


def default_device() -> str:
    """The device the webuis run models on: CUDA (or ROCm), else MPS on a Mac, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Facts about ``device``; with None, the ``default_device()``.

    Calling this with a CUDA device initialises CUDA, so the engine only does it on a real call.
    """
    if device is None:
        device = default_device()
    device = torch.device(device)
    return _info(device.type, device.index)


def cpu_model() -> str:
    """The processor's model name where the OS tells it (Linux: /proc/cpuinfo), else what the platform
    module knows ("x86_64" at worst)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine() or "unknown processor"
