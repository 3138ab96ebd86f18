"""Kernels from the Hugging Face kernel hub, taken only from the local cache.

The ``kernels`` package downloads prebuilt kernel repositories (``kernels-community/flash-attn3``, ...)
into the Hugging Face cache, one build folder per torch/CUDA/platform (``build/torch29-cxx11-cu130-
x86_64-linux``). Builds exist there for torch releases and CUDA versions that have no official wheel.
The engine loads such a build only when ``kernels`` is installed and the build for the running torch is
already in the cache: it never downloads (install.py does, when the user sets ``ATTN_INSTALL``), so an
offline machine behaves like any other. Nothing here touches CUDA: the build is chosen from
``torch.version.cuda`` and the torch release.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from . import hub_cache
from .base import failure_text

#: The hub repository of each kind of kernel the engine can take from the hub.
REPOS = {
    "flash-attn2": "kernels-community/flash-attn2",
    "flash-attn3": "kernels-community/flash-attn3",
    "sage": "kernels-community/sage-attention",
}

_loaded: dict[str, tuple] = {}


def build_name() -> str:
    """The start and end of the build folder that fits this torch: ``torch29-*-cu130-x86_64-linux``."""
    return hub_cache.build_pattern(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None))


def cached_build(kind: str) -> Path | None:
    """The newest cached build folder of ``kind`` for this torch, or None."""
    return hub_cache.cached_build(REPOS[kind], build_name())


def _package_init(build: Path) -> Path | None:
    """A build folder is the package itself or holds it as its one subfolder with an __init__.py."""
    if (build / "__init__.py").is_file():
        return build / "__init__.py"
    inits = sorted(build.glob("*/__init__.py"))
    return inits[0] if inits else None


def load(kind: str):
    """(module, "") for the cached hub build of ``kind`` (a key of ``REPOS``), or (None, reason).

    Imports the build once per process and never downloads."""
    if kind not in REPOS:
        raise ValueError(f"unknown hub kernel {kind!r} (known: {', '.join(REPOS)})")
    if kind not in _loaded:
        _loaded[kind] = _load(kind)
    return _loaded[kind]


def _load(kind: str):
    if importlib.util.find_spec("kernels") is None:
        return None, "the kernels package is not installed (pip install kernels)"
    build = cached_build(kind)
    if build is None:
        return None, (f"no build of {REPOS[kind]} for {build_name().replace('-*-', '-...-')} in the local "
                      f"cache; ATTN_INSTALL=hub-{kind} fetches it (nothing is downloaded otherwise)")
    init = _package_init(build)
    if init is None:
        return None, f"{build} holds no Python package"
    name = f"_attn_hub_{kind.replace('-', '_')}"
    try:
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except (ImportError, OSError, RuntimeError, AttributeError, SyntaxError) as exc:
        sys.modules.pop(name, None)
        return None, f"{REPOS[kind]} ({build.name}) does not load: {failure_text(exc)}"
    module.hub_source = f"{REPOS[kind]} {build.parent.parent.name[:8]} {build.name}"
    return module, ""


def forget() -> None:
    """Forget what was loaded (tests, and after a download at run time)."""
    _loaded.clear()
