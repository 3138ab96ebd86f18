"""What this machine has, as plain data: the Python, torch, CUDA and cuDNN (on ROCm: HIP and MIOpen)
versions, the device, every backend (available, version, or the reason it is not) and the version of
every distribution the backends probe (the kernel hub's ``kernels`` and FlashAttention-4's
``flash-attn-4`` among them), or None where it is not installed. The header of
the doctor, bench and tune reports; given a described device (a ``DeviceInfo``), that device instead."""
from __future__ import annotations

import importlib.metadata
import platform
from typing import Optional

import torch

import lib_attn
from lib_attn.device import cpu_model, default_device, miopen_text

#: Installed distributions the commands use beside the ones the backends probe (``Backend.packages``).
COMMAND_PACKAGES = ("numpy", "matplotlib")


def _package_versions(names) -> dict:
    """{distribution: version, or None when not installed}, read from metadata (nothing is imported)."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cudnn_version() -> Optional[int]:
    """The cuDNN this torch build carries: known from the build alone, with or without a GPU."""
    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def _device_dict(device: torch.device, info=None) -> dict:
    info = info or lib_attn.device_info(device)
    cap = getattr(info, "capability", None)
    d = {
        "type": info.type,
        "index": getattr(info, "index", None),
        "name": info.name,
        "capability": list(cap) if cap else None,
        "total_memory": getattr(info, "total_memory", None),
        "threads": torch.get_num_threads(),
        "platform": info.platform,
        "arch": info.arch or None,
        "hip": info.hip,
        "miopen": info.miopen,
        "macos": list(info.macos) if info.macos else None,
    }
    if info.platform == "rocm":
        mem = f", {d['total_memory'] / 2**30:.1f} GiB" if d["total_memory"] else ""
        d["description"] = (f"{info.name} ({info.arch or 'gfx?'}, ROCm: HIP {info.hip or '?'}, "
                            f"MIOpen {miopen_text(info.miopen)}{mem})")
    elif info.platform == "mps":
        mem = f", {d['total_memory'] / 2**30:.1f} GiB recommended" if d["total_memory"] else ""
        d["description"] = f"{info.name} (MPS{mem})"
    elif info.type == "cuda":
        mem = f", {d['total_memory'] / 2**30:.1f} GiB" if d["total_memory"] else ""
        sm = f"sm{cap[0]}{cap[1]}" if cap else "sm?"
        d["description"] = f"{info.name} ({sm}{mem})"
    else:
        d["cpu_model"] = cpu_model()
        d["description"] = f"CPU only ({d['cpu_model'] or info.name}, {d['threads']} threads)"
    return d


def environment(device: Optional[torch.device] = None, info=None) -> dict:
    """Versions, the device and every backend, as plain data; ``info`` describes the device instead."""
    if info is not None:
        device = torch.device(info.type)
    if device is None:
        device = torch.device(default_device())
    dev = _device_dict(device, info)
    rocm = dev["platform"] == "rocm"
    infos = lib_attn.backends()
    backends = [{"id": b.id, "label": b.label, "available": bool(b.available),
                 "reason": b.reason or "", "version": b.version, "packages": list(b.packages)} for b in infos]
    probed = list(dict.fromkeys(name for b in infos for name in b.packages))
    versions = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": dev["hip"] if rocm else getattr(torch.version, "hip", None),
        # On ROCm torch.backends.cudnn is MIOpen: its version is not a cuDNN one.
        "cudnn": None if rocm or getattr(torch.version, "hip", None) else _cudnn_version(),
        "miopen": dev["miopen"] if rocm else None,
        "lib_attn": lib_attn.__version__,
        "backends": {b["id"]: b["version"] for b in backends},
        "packages": _package_versions(probed + [n for n in COMMAND_PACKAGES if n not in probed]),
    }
    return {"versions": versions, "device": dev, "backends": backends}
