"""The backends (one module each) and their registry: every backend once, by stable id, and each one's probe, run once."""
from __future__ import annotations

from .base import Backend, Status
from .flash import FlashAttn
from .math import Math
from .sage import Sage
from .sdpa import Sdpa, SdpaCudnn, SdpaEfficient, SdpaFlash, SdpaMath
from .xformers import Xformers

REGISTRY: dict[str, Backend] = {
    b.id: b
    for b in (FlashAttn(), SdpaCudnn(), SdpaFlash(), SdpaEfficient(), Xformers(), Sage(), Sdpa(), SdpaMath(), Math())
}
BACKEND_IDS = tuple(REGISTRY)

_status: dict[str, Status] = {}


def status(backend_id: str) -> Status:
    """The backend's probe result, computed on first use (imports the package, never touches CUDA)."""
    found = _status.get(backend_id)
    if found is None:
        found = _status[backend_id] = REGISTRY[backend_id].probe()
    return found


def statuses() -> dict[str, Status]:
    return {bid: status(bid) for bid in BACKEND_IDS}


def reset_probes() -> None:
    """Forget every probe (tests, and after installing a package at run time)."""
    _status.clear()
