"""Which kernel hub builds are in the local cache, without torch: the torch release and its CUDA or ROCm
version are given, so that ``install.py`` (which reads package metadata only, and loads this file by its
path) asks exactly what the engine asks before it downloads anything.

``kernels`` keeps one build folder per torch/CUDA/platform under each repository's snapshots
(``build/torch29-cxx11-cu130-x86_64-linux``), in ``KERNELS_CACHE`` or the Hugging Face hub cache.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_roots() -> list[Path]:
    """Where ``kernels`` keeps downloaded builds: ``KERNELS_CACHE``, else the Hugging Face hub cache."""
    roots = []
    if os.environ.get("KERNELS_CACHE"):
        roots.append(Path(os.environ["KERNELS_CACHE"]))
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        roots.append(Path(hub))
    else:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        roots.append(Path(home).expanduser() / "hub")
    return roots


def build_pattern(release: str, cuda: str | None, hip: str | None) -> str:
    """The start and end of the build folder that fits a torch: ``torch29-*-cu130-x86_64-linux`` for
    ``release`` 2.9.x with CUDA 13.0."""
    mm = "".join(release.split("+")[0].split(".")[:2])
    runtime = (f"cu{cuda.replace('.', '')}" if cuda else
               (f"rocm{''.join(hip.split('.')[:2])}" if hip else "cpu"))
    machine = platform.machine().lower().replace("amd64", "x86_64")
    return f"torch{mm}-*-{runtime}-{machine}-{platform.system().lower()}"


def matches(folder: str, wanted: str) -> bool:
    head, tail = wanted.split("-*-")
    return folder.startswith(head + "-") and folder.endswith("-" + tail)


def cached_build(repo: str, wanted: str) -> Path | None:
    """The newest cached build folder of the hub repository ``repo`` matching ``wanted``, or None."""
    org, name = repo.split("/")
    found = []
    for root in cache_roots():
        for prefix in ("kernels", "models"):  # kernels >= 0.13 stores kernel repos; older ones, model repos
            snapshots = root / f"{prefix}--{org}--{name}" / "snapshots"
            if snapshots.is_dir():
                found += [b for b in snapshots.glob("*/build/*") if b.is_dir() and matches(b.name, wanted)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None
