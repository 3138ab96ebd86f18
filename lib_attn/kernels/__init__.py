"""The backends (one module each) and their registry: every backend once, by stable id, and each one's probe, run once.

``REGISTRY`` maps ids to backends, built-ins first, then any added with ``register``. ``BACKEND_IDS``
is a live, read-only view of the ids a chain may name (a backend registered later is in it at once);
``SPARSE_IDS`` the same of the sparse backends (``sparse.SparseBackend``), which no chain names: the
sparse settings (``lib_attn.sparse``) choose them, and the engine holds them to the error budget.
"""
from __future__ import annotations

from collections.abc import Sequence

from . import hub
from .base import Backend, Status
from .block_sparse import BlockSparse
from .flash import FlashAttn
from .flash4 import FlashAttn4
from .kitchen import CkInt8
from .math import Math
from .sage import Sage, SageCuda, SageFp8, SageFp8pp, SageTriton
from .sage3 import Sage3
from .sdpa import Sdpa, SdpaCudnn, SdpaEfficient, SdpaFlash, SdpaHost, SdpaMath
from .sol import Sol
from .sparse import is_sparse
from .xformers import Xformers

REGISTRY: dict[str, Backend] = {
    b.id: b
    for b in (FlashAttn(), FlashAttn4(), SdpaCudnn(), SdpaFlash(), SdpaEfficient(), Xformers(), Sage(), SageTriton(),
              SageCuda(), SageFp8(), SageFp8pp(), Sage3(), CkInt8(), Sdpa(), SdpaMath(), Math(), SdpaHost(), Sol(), BlockSparse())
}
BUILTIN_IDS = tuple(REGISTRY)


class _Ids(Sequence):
    """The registry's ids of one kind (``sparse`` or not) in order, as a read-only sequence that compares
    equal to a tuple of them."""

    def __init__(self, sparse: bool):
        self.sparse = sparse

    def _ids(self) -> tuple:
        return tuple(bid for bid, b in REGISTRY.items() if is_sparse(b) == self.sparse)

    def __getitem__(self, index):
        return self._ids()[index]

    def __len__(self) -> int:
        return len(self._ids())

    def __iter__(self):
        return iter(self._ids())

    def __contains__(self, item) -> bool:
        backend = REGISTRY.get(item) if isinstance(item, str) else None
        return backend is not None and is_sparse(backend) == self.sparse

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and tuple(self) == tuple(other)

    __hash__ = None

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return repr(self._ids())


BACKEND_IDS = _Ids(sparse=False)
SPARSE_IDS = _Ids(sparse=True)


def not_in_chains(ids) -> str:
    """Why the sparse ids among ``ids`` cannot be in a chain ("" when none is)."""
    named = [i for i in ids if i in SPARSE_IDS]
    if not named:
        return ""
    return (f"{', '.join(map(repr, named))} {'is a sparse backend' if len(named) == 1 else 'are sparse backends'}, "
            "which no chain names: turn sparse attention on with the sparse settings "
            "(lib_attn.configure(sparse=...)), which hold it to an error budget")

_status: dict[str, Status] = {}


def status(backend_id: str) -> Status:
    """The backend's probe result, computed on first use (imports the package, never touches CUDA)."""
    found = _status.get(backend_id)
    if found is None:
        backend = REGISTRY[backend_id]
        found = backend.probe()
        if not getattr(backend, "probe_each_time", False):
            _status[backend_id] = found
    return found


def statuses() -> dict[str, Status]:
    return {bid: status(bid) for bid in BACKEND_IDS}


def register(backend: Backend) -> None:
    """Add ``backend`` (an instance of a ``Backend`` subclass) under its ``id``; it replaces an
    earlier registration of that id, never a built-in."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes an instance of a lib_attn.Backend subclass, got {type(backend).__name__}")
    bid = backend.id
    if not isinstance(bid, str) or not bid.strip() or bid != bid.strip() or "," in bid or bid == "auto":
        raise ValueError(f"backend id {bid!r} must be a non-empty name without spaces at its ends, commas, or 'auto'")
    if bid in BUILTIN_IDS:
        raise ValueError(f"backend id {bid!r} is a built-in backend's id; choose another")
    if not backend.devices or not backend.dtypes:
        raise ValueError(f"backend {bid!r} must name its devices and dtypes")
    if type(backend).run is Backend.run and type(backend).runner is Backend.runner:
        raise ValueError(f"backend {bid!r} must override run(q, k, v, mask, scale)")
    REGISTRY[bid] = backend
    _status.pop(bid, None)


def unregister(backend_id: str) -> None:
    """Remove a registered backend (built-ins stay)."""
    if backend_id in BUILTIN_IDS:
        raise ValueError(f"{backend_id!r} is a built-in backend and cannot be removed")
    REGISTRY.pop(backend_id, None)
    _status.pop(backend_id, None)


def reset_probes() -> None:
    """Forget every probe (tests, and after installing a package at run time)."""
    _status.clear()
    hub.forget()
