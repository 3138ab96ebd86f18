"""The tuning file: the rankings and rejections of each call signature on this machine, kept on disk.

Results are stored in ``tuning.json`` in ``cache_dir()``, keyed by a fingerprint of the machine and
its software (device facts, driver, torch, CUDA, cuDNN, each backend's version, lib_attn) and by the
signature. Processes that tune at once (one web UI per GPU, ``python -m lib_attn tune`` beside a
web UI) take turns on ``tuning.json.lock`` next to it (``file_lock``): each write reads the file,
merges its own entries into what the others wrote, and replaces it atomically (a temporary file in
the same directory, then ``os.replace``), all under the lock, so no process drops another's results.
A process that waits more than ``LOCK_TIMEOUT_S`` for the lock logs one line and keeps its results in
memory; its next write tries the lock without waiting and, once it gets it, stores them all.

A file that is not a tuning file (not UTF-8, not JSON, another schema) is renamed to
``tuning.json.corrupt-<local time>`` (``-2``, ``-3`` ... appended when taken), named in one log line,
and tuning goes on with a new file. A file that cannot be read (permissions) is left untouched; it,
like a directory that cannot be written, costs one log line, and tuning then works in memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

import torch

from . import _compat
from ._version import __version__
from .check import CHECK_FAILED
from .device import device_info
from .file_lock import FileLock
from .kernels import BACKEND_IDS, REGISTRY, status
from .kernels.base import failure_text
from .spec import NO_MASK

log = logging.getLogger("lib_attn")

SCHEMA = "lib_attn.tune/1"
FILE_NAME = "tuning.json"
ENV_DIR = "LIB_ATTN_CACHE_DIR"
LOCK_SUFFIX = ".lock"
#: Seconds a process waits for another one to finish its write before it keeps its results in memory.
LOCK_TIMEOUT_S = 5.0


# --- keys -------------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def call_fields(spec, fp32: str) -> dict:
    """The signature of a call as plain data (what the file stores next to its key)."""
    mask = spec.mask if spec.mask == NO_MASK else f"{spec.mask} {_dtype_name(spec.mask_dtype)}"
    return {"role": spec.role, "layout": spec.layout, "dtype": spec.dtype_name,
            "shape": [spec.batch, spec.heads, spec.q_len, spec.kv_len, spec.head_dim],
            "mask": mask, "grad": bool(spec.requires_grad), "fp32": fp32}


def signature(spec, fp32: str) -> str:
    f = call_fields(spec, fp32)
    return " ".join([f["role"], f["layout"], f["dtype"], "x".join(map(str, f["shape"])), f"mask={f['mask']}",
                     "grad" if f["grad"] else "nograd", f"fp32={fp32}"])


def fingerprint(device) -> dict:
    """What a ranking depends on besides the call: the device (every field of its ``DeviceInfo``),
    driver, torch, CUDA, cuDNN, lib_attn and each available backend's version."""
    cuda = device.type == "cuda"
    doc = {
        "device": dataclasses.asdict(device),
        "driver": _compat.cuda_driver_version() if cuda else None,
        "torch": _compat.TORCH_VERSION_TEXT,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None,
        "lib_attn": __version__,
        # A backend probed at each use (sdpa-host: whatever the host put in place of SDPA) comes and goes
        # within a run; the rankings of the others do not depend on it.
        "backends": {bid: status(bid).version for bid in list(BACKEND_IDS)
                     if not getattr(REGISTRY[bid], "probe_each_time", False) and status(bid).available},
    }
    return json.loads(json.dumps(doc, sort_keys=True, default=str))


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


# --- the file ---------------------------------------------------------------------------------

def cache_dir() -> str:
    """``$LIB_ATTN_CACHE_DIR`` when set; else ``%LOCALAPPDATA%\\lib_attn`` on Windows and
    ``$XDG_CACHE_HOME/lib_attn`` (default ``~/.cache/lib_attn``) elsewhere."""
    env = os.environ.get(ENV_DIR)
    if env:
        return env
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return os.path.join(os.environ["LOCALAPPDATA"], "lib_attn")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lib_attn")


def cache_path() -> str:
    return os.path.join(cache_dir(), FILE_NAME)


def _valid_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("timings"), dict)
            and isinstance(entry.get("rejected"), dict)
            and all(isinstance(t, (int, float)) for t in entry["timings"].values()))


def _parse(text: str) -> dict:
    """The machines of a file's text; ValueError when it is not a tuning file."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("machines"), dict):
        raise ValueError(f"not a {SCHEMA} file")
    machines = {}
    for key, machine in doc["machines"].items():
        if isinstance(machine, dict) and isinstance(machine.get("entries"), dict):
            entries = {sig: e for sig, e in machine["entries"].items() if _valid_entry(e)}
            machines[key] = {"fingerprint": machine.get("fingerprint") or {}, "entries": entries}
    return machines


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _set_aside(path: str) -> str:
    """Rename the file at ``path`` to ``<path>.corrupt-<local time>``, with ``-2``, ``-3``, ... added
    when that name is taken; the new path. Called with the lock held, so no other process of this
    module picks the same name between the check and the rename (which on POSIX would replace it)."""
    stem = f"{path}.corrupt-{_stamp()}"
    target, n = stem, 1
    while os.path.lexists(target):
        n += 1
        target = f"{stem}-{n}"
    os.rename(path, target)
    return target


class Store:
    """The tuning results of this process, mirrored to the file in ``cache_path()``."""

    def __init__(self):
        self.machines: dict = {}
        self._path: str | None = None
        self._logged: set = set()
        self._gave_up: set = set()  # files whose lock another process held past the timeout

    def _log_once(self, what: str, path: str, exc: BaseException) -> None:
        if (what, path) not in self._logged:
            self._logged.add((what, path))
            log.warning("attention tuning: %s %s (%s); tuning results are kept in memory", what, path,
                        failure_text(exc))

    def _lock(self, path: str, quiet: bool = False) -> FileLock | None:
        """The lock of the file at ``path``, held; None (logged once) when it cannot be had; ``quiet``:
        log only a timeout. After one timeout the next tries do not wait, so a stuck holder costs
        ``LOCK_TIMEOUT_S`` once."""
        lock = FileLock(path + LOCK_SUFFIX)
        try:
            lock.acquire(0 if path in self._gave_up else LOCK_TIMEOUT_S)
        except TimeoutError as exc:
            self._gave_up.add(path)
            self._log_once("cannot lock", lock.path, exc)
            return None
        except OSError as exc:
            if not quiet:
                self._log_once("cannot lock", lock.path, exc)
            return None
        self._gave_up.discard(path)
        return lock

    def _read(self, path: str, locked: bool) -> dict | None:
        """The machines in the file: {} when there is none, or when it was corrupt and has been set
        aside (only with the lock held); None, logged once, when it cannot be used."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return {}
        except OSError as exc:  # e.g. no permission: left where it is
            self._log_once("cannot use", path, exc)
            return None
        try:
            return _parse(data.decode("utf-8"))
        except ValueError as exc:  # not UTF-8, not JSON, or not a tuning file
            if not locked:
                self._log_once("cannot use", path, exc)
                return None
            try:
                aside = _set_aside(path)
            except OSError as err:
                self._log_once("cannot set aside", path, err)
                return None
            log.warning("attention tuning: %s is no tuning file (%s); moved it to %s and started a new one",
                        path, failure_text(exc), aside)
            return {}

    def load(self) -> None:
        """Read the file once per path (the directory may change between tests)."""
        path = cache_path()
        if path != self._path:
            self._path = path
            if not os.path.exists(path):
                self.machines = {}
                return
            # With the lock, so that a corrupt file can be set aside; without it when it cannot be had
            # (a read-only directory is reported by the first write, if any).
            lock = self._lock(path, quiet=True)
            try:
                self.machines = self._read(path, locked=lock is not None) or {}
            finally:
                if lock is not None:
                    lock.release()

    def entry(self, key: str, sig: str) -> dict | None:
        self.load()
        return self.machines.get(key, {}).get("entries", {}).get(sig)

    def put(self, key: str, fp: dict, sig: str, entry: dict) -> None:
        self.load()
        self.machines.setdefault(key, {"fingerprint": fp, "entries": {}})["entries"][sig] = entry
        self._write({key: {sig: entry}})

    def _write(self, ours: dict) -> None:
        """Merge this process's entries into the file, under its lock; ``ours`` (key -> sig -> entry)
        replace what the file has for them, the file's own entries are kept."""
        path = self._path
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            self._log_once("cannot write", path, exc)
            return
        lock = self._lock(path)
        if lock is None:
            return
        tmp = None
        try:
            # Another process may have added entries since this one read the file: keep them.
            merged = self._read(path, locked=True)
            if merged is None:
                return  # a file this process cannot read is not replaced
            for key, machine in self.machines.items():
                slot = merged.setdefault(key, {"fingerprint": machine["fingerprint"], "entries": {}})
                for sig, entry in machine["entries"].items():
                    if sig in ours.get(key, {}) or sig not in slot["entries"]:
                        slot["entries"][sig] = entry
            fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".tmp", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"schema": SCHEMA, "machines": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
            self.machines = merged
        except OSError as exc:
            self._log_once("cannot write", path, exc)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            lock.release()

    def clear(self) -> bool:
        """Forget every result, in memory and on disk; True when a file was removed. The lock file
        stays (see ``file_lock``)."""
        self.machines = {}
        self._path = cache_path()
        lock = self._lock(self._path) if os.path.exists(self._path) else None
        try:
            os.remove(self._path)
            return True
        except FileNotFoundError:
            return False
        finally:
            if lock is not None:
                lock.release()


_store = Store()
#: Held while a ranking is looked up, measured and stored, so that two threads never measure one
#: signature at once.
lock = threading.RLock()


def clear() -> bool:
    """Forget every stored ranking (``python -m lib_attn tune --clear``); True when a file was removed."""
    with lock:
        return _store.clear()


def forget_memory() -> None:
    """Drop the in-memory copy so that the file is read again on next use (tests)."""
    with lock:
        _store._path = None
        _store.machines = {}


def lookup(spec, fp32: str) -> dict | None:
    """The stored entry for a call on this machine, or None (never measures)."""
    with lock:
        return _store.entry(fingerprint_key(fingerprint(spec.device)), signature(spec, fp32))


def table(device=None) -> dict:
    """The stored rankings of this machine: ``{"file", "fingerprint", "entries": [...]}`` where each
    entry has ``call`` (its signature as data), ``winner``, ``timings`` and ``rejected``."""
    device = device or device_info()
    fp = fingerprint(device)
    with lock:
        _store.load()
        machine = _store.machines.get(fingerprint_key(fp), {"entries": {}})
        entries = [dict(e, signature=sig) for sig, e in sorted(machine["entries"].items())]
    return {"file": cache_path(), "fingerprint": fp, "entries": entries}


def rejections(spec, fp32: str) -> dict:
    """{backend id: reason} of the backends whose output failed its check on this call signature on
    this machine (by tuning or by the guard, in this process or an earlier one)."""
    entry = lookup(spec, fp32)
    if entry is None:
        return {}
    return {bid: str(r) for bid, r in entry["rejected"].items() if str(r).startswith(CHECK_FAILED)}


def reject(spec, fp32: str, backend_id: str, reason: str) -> None:
    """Remember that ``backend_id``'s output failed its check on this signature: in this process,
    and in the tuning file under this machine's fingerprint, so that the next start skips it too."""
    fp = fingerprint(spec.device)
    key, sig = fingerprint_key(fp), signature(spec, fp32)
    with lock:
        entry = _store.entry(key, sig)
        new = dict(entry) if entry else {"call": call_fields(spec, fp32), "timings": {}, "winner": None}
        new["rejected"] = dict(entry["rejected"]) if entry else {}
        new["rejected"][backend_id] = reason
        new["timings"] = {b: t for b, t in new["timings"].items() if b != backend_id}
        new["winner"] = min(new["timings"], key=new["timings"].get) if new["timings"] else None
        _store.put(key, fp, sig, new)


def remembered(device=None) -> list:
    """The stored check failures of this machine, sorted: ``{"signature", "backend", "reason"}`` each."""
    found = sorted((e["signature"], bid, str(r)) for e in table(device)["entries"]
                   for bid, r in e["rejected"].items() if str(r).startswith(CHECK_FAILED))
    return [{"signature": sig, "backend": bid, "reason": why} for sig, bid, why in found]



def stored(spec, fp32: str, ids: list) -> tuple[dict, dict] | None:
    """(timings fastest first, rejections) of the backends ``ids`` for a call, when the file has every
    one of them for its signature on this machine; else None."""
    with lock:
        entry = _store.entry(fingerprint_key(fingerprint(spec.device)), signature(spec, fp32))
    if entry is None or not all(i in entry["timings"] or i in entry["rejected"] for i in ids):
        return None
    timings = {i: float(t) for i, t in sorted(entry["timings"].items(), key=lambda item: item[1]) if i in ids}
    return timings, {i: str(r) for i, r in entry["rejected"].items() if i in ids}


def record(spec, fp32: str, ids: list, timings: dict, rejected: dict) -> None:
    """Store what measuring ``ids`` found for a call, over what the file had for them (its other
    backends' results are kept)."""
    fp = fingerprint(spec.device)
    key, sig = fingerprint_key(fp), signature(spec, fp32)
    with lock:
        entry = _store.entry(key, sig)
        new = {"call": call_fields(spec, fp32), "timings": dict(entry["timings"]) if entry else {},
               "rejected": dict(entry["rejected"]) if entry else {}}
        for i in ids:
            new["timings"].pop(i, None)
            new["rejected"].pop(i, None)
        new["timings"].update(timings)
        new["rejected"].update(rejected)
        new["winner"] = min(new["timings"], key=new["timings"].get) if new["timings"] else None
        new["measured"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _store.put(key, fp, sig, new)
