"""lib_attn: one attention call, run on the fastest kernel that can take it, with reasons.

    out = lib_attn.attention(q, k, v)                  # (b, h, seq, d) in, same layout out
    out = lib_attn.attention(q, k, v, layout="bshd")   # (b, seq, h, d), flash-attn's layout
    print(lib_attn.explain(q, k, v))                   # which backend, and why the others not
    lib_attn.configure(schedule="0-20%: sdpa; 20-80%: sage; 80-100%: sdpa")   # by sampling progress
    with lib_attn.use(preference=["flash-attn"]):      # scoped configuration
        ...
    with lib_attn.recording() as rec:                  # what ran, per (role, backend)
        ...
    lib_attn.configure(tune="on")                      # rank the kernels by measuring them
    lib_attn.register_backend(MyKernel())              # a lib_attn.Backend subclass
    lib_attn.configure(sparse="block-sparse, budget=0.15")   # long self-attention sparse, within an error budget

Importing this package imports torch and nothing of any webui, and does not initialise CUDA.
The public API is ``__all__``; everything else is the engine's own.
"""
import dataclasses as _dataclasses

from . import dispatch as _dispatch
from . import kernels as _kernels
from . import schedule as _schedule
from ._version import __version__
from .config import Config, configure, use
from .config import current as config
from .device import DeviceInfo, device_info
from .chains import default_chain
from .decision import Decision
from .dispatch import AttentionFallbackError, attention, explain
from .kernels import BACKEND_IDS, SPARSE_IDS, Backend, Status
from .kernels.sparse import Knob, SparseBackend, SparseResult
from . import readout  # noqa: F401 - lib_attn.readout.text(report): the lines hosts show, for scripts
from .report import Report, Vram, VramProbe
from .schedule import Schedule, ScheduleError
from .sparse import Sparse, SparseError
from .spec import LAYOUTS, ROLES, CallSpec
from .stats import Recording, last_recording, recording

__all__ = [
    "attention", "explain", "backends", "configure", "use", "config", "recording", "last_recording",
    "default_chain", "device_info", "reset", "BACKEND_IDS", "ROLES", "LAYOUTS", "AttentionFallbackError",
    "BackendInfo", "CallSpec", "Config", "Decision", "DeviceInfo", "Recording",
    "Backend", "Status", "register_backend", "unregister_backend", "Report", "Vram", "VramProbe",
    "Schedule", "ScheduleError", "Sparse", "SparseError", "SparseBackend", "SparseResult", "Knob", "SPARSE_IDS",
]


@_dataclasses.dataclass(frozen=True)
class BackendInfo:
    """One backend as ``backends()`` lists it: ``reason`` says why not when ``available`` is False;
    ``packages``: the distributions its probe looks for."""

    id: str
    label: str
    available: bool
    reason: str
    version: str
    packages: tuple = ()


def backends(sparse: bool = False) -> "list[BackendInfo]":
    """Every backend a chain may name (``sparse``: every sparse backend instead), in registry order,
    with its probe result (probes run once, on first use)."""
    out = []
    for bid in SPARSE_IDS if sparse else BACKEND_IDS:
        st = _kernels.status(bid)
        backend = _kernels.REGISTRY[bid]
        out.append(BackendInfo(bid, backend.label, st.available, st.reason, st.version, tuple(backend.packages)))
    return out


def register_backend(backend: Backend) -> None:
    """Add a backend: an instance of a ``lib_attn.Backend`` subclass (see its docstring and docs/engine-api.md).

    Its ``id`` becomes valid wherever a built-in id is (chains, per-call ``backend``, flags, settings).
    It is never in a default chain: a user's chain names it. A ``lib_attn.SparseBackend`` becomes a
    sparse method instead (``configure(sparse=...)``), which no chain names. Registering an id again replaces the
    earlier backend; decisions taken so far are dropped.
    """
    _kernels.register(backend)
    _dispatch.reset()


def unregister_backend(backend_id: str) -> None:
    """Remove a registered backend; decisions taken so far are dropped."""
    _kernels.unregister(backend_id)
    _dispatch.reset()


def reset() -> None:
    """Back to a fresh state: default configuration, no cached decision or demotion (tests)."""
    configure(preference="auto", fp32="cast", strict=False, tune="auto", avoid=(), guard="on", schedule="", sparse="")
    _schedule.leave()
    _dispatch.reset()


def __getattr__(name: str):
    # ``lib_attn.parallel`` (several processes, torch.distributed) loads on first use, not with the engine.
    if name == "parallel":
        import importlib

        return importlib.import_module(".parallel", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
