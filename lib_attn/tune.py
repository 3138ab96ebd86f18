"""Tuning: rank the backends that take a call kind by measuring them on its first call, check each
one's output, and keep the ranking on disk so that later processes do not measure again.

What runs, per call signature (the key the dispatcher caches decisions under), under ``no_grad``,
with no copy of the call's inputs:

* each candidate once on ``check.probe``'s copies of a part of the call (the whole call when small,
  whose output is then checked as below), compared with the caller's tensors bit for bit: a
  candidate that writes into them is rejected there, and so never runs on the caller's tensors;
* each candidate that passed, once on the *timed part* (``timed_part``): views of the caller's
  tensors, the whole call up to ``TIMED_WORK`` FLOPs, else its first batch items and heads at full
  lengths with about that much work (never fewer heads than keep every SM busy for
  ``TILES_PER_UNIT`` waves of query tiles). That call is checked on its sampled rows, the bits of
  its inputs are summed before and after (``check.checksums``), and it warms the kernel up (lazy
  initialisation, autotuning, JIT compiles stay out of the timings). A candidate whose checked call
  took more than ``SLOWER`` times the fastest checked call, or longer than ``BUDGET_S`` and longer
  than the fastest, stops here (that call is its time);
* one timed call of each other candidate; those more than ``SLOWER`` times slower than the fastest
  of these, or longer than ``BUDGET_S``, stop here;
* up to ``REPS`` - 2 rounds of one timed call per remaining candidate, as many as fit in
  ``BUDGET_S``; rounds interleave the candidates, so drift affects them alike.

Why a part's time ranks the kernels as the whole call would: a fused kernel splits a call into
query tiles per (batch, head) and runs them in waves over the device's processors; with the same
lengths, dtype and head size, each (batch, head) is the same code on the same amount of work, so
once the part fills several waves its time grows in proportion to batch x heads. Stored timings are
the part's medians divided by its share of the call. So a long video call costs one small probe and
one part-sized call per candidate, about one more of each that may win, and at most ``BUDGET_S`` of
rounds, and its extra memory is the probe's copies (at most ``check.PROBE_BYTES``), the reference's
blocks (``check.BLOCK_BYTES``) and one candidate's output of the part at a time (never more than the
call's own output). CUDA events time a GPU, ``time.perf_counter`` anything else. The fastest
median wins.

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
from dataclasses import dataclass, field

import torch

from . import _compat
from . import check as _check
from ._version import __version__
from .device import device_info
from .file_lock import FileLock
from .kernels import REGISTRY, status
from .kernels.base import failure_text, is_sticky
from .shapes import attention_flops
from .spec import NO_MASK

log = logging.getLogger("lib_attn")

SCHEMA = "lib_attn.tune/1"
FILE_NAME = "tuning.json"
ENV_DIR = "LIB_ATTN_CACHE_DIR"
LOCK_SUFFIX = ".lock"
#: Seconds a process waits for another one to finish its write before it keeps its results in memory.
LOCK_TIMEOUT_S = 5.0

REPS = 5
BUDGET_S = 0.3
SLOWER = 25
@dataclass(frozen=True)
class Candidate:
    """One backend that takes the call: ``run`` takes (q, k, v, mask, scale) as the caller passes
    them; ``dtype`` is the dtype it computes in (after a cast)."""

    id: str
    run: object = field(repr=False)
    dtype: torch.dtype = torch.float32
    approximate: bool = False


@dataclass(frozen=True)
class Ranking:
    """``timings``: backend id -> median seconds, fastest first; ``rejected``: id -> reason;
    ``source``: ``"measured"`` (now) or ``"stored"`` (from the file); ``keep``: False when a candidate
    ran out of memory, which may not happen on the next run, so the ranking is not stored."""

    source: str
    timings: dict
    rejected: dict
    keep: bool = True

    @property
    def winner(self) -> str | None:
        return next(iter(self.timings), None)


# --- when tuning applies ---------------------------------------------------------------------

def enabled(mode: str, device_type: str) -> bool:
    """Whether configuration ``mode`` measures on this device type."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def blocked(device_type: str) -> str | None:
    """Why kernels must not be measured now (tracing, capture, backward), or None."""
    if _compat.compiling():
        return "torch.compile or TorchScript is tracing"
    if _compat.in_backward():
        return "inside a backward pass"
    if _compat.capturing(device_type):
        return "a CUDA graph is being captured"
    return None


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
        "backends": {bid: status(bid).version for bid in list(REGISTRY) if status(bid).available},
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
_lock = threading.RLock()


def clear() -> bool:
    """Forget every stored ranking (``python -m lib_attn tune --clear``); True when a file was removed."""
    with _lock:
        return _store.clear()


def forget_memory() -> None:
    """Drop the in-memory copy so that the file is read again on next use (tests)."""
    with _lock:
        _store._path = None
        _store.machines = {}


def lookup(spec, fp32: str) -> dict | None:
    """The stored entry for a call on this machine, or None (never measures)."""
    with _lock:
        return _store.entry(fingerprint_key(fingerprint(spec.device)), signature(spec, fp32))


def table(device=None) -> dict:
    """The stored rankings of this machine: ``{"file", "fingerprint", "entries": [...]}`` where each
    entry has ``call`` (its signature as data), ``winner``, ``timings`` and ``rejected``."""
    device = device or device_info()
    fp = fingerprint(device)
    with _lock:
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
    return {bid: str(r) for bid, r in entry["rejected"].items() if str(r).startswith(_check.CHECK_FAILED)}


def reject(spec, fp32: str, backend_id: str, reason: str) -> None:
    """Remember that ``backend_id``'s output failed its check on this signature: in this process,
    and in the tuning file under this machine's fingerprint, so that the next start skips it too."""
    fp = fingerprint(spec.device)
    key, sig = fingerprint_key(fp), signature(spec, fp32)
    with _lock:
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
                   for bid, r in e["rejected"].items() if str(r).startswith(_check.CHECK_FAILED))
    return [{"signature": sig, "backend": bid, "reason": why} for sig, bid, why in found]


# --- measuring --------------------------------------------------------------------------------

class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def times(self, fn, n: int) -> list:
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            self.sync()
            return [s.elapsed_time(e) * 1e-3 for s, e in events]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out


def ms_text(seconds: float) -> str:
    """A median for people: ``2188 ms``, ``45.6 ms``, ``0.123 ms``."""
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _median(values: list) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


#: Work (forward FLOPs, ``shapes.attention_flops``) above which candidates are timed on a part of
#: the call, per device type (others: the CPU's).
TIMED_WORK = {"cuda": 2e12, "cpu": 4e9}
#: A timed part keeps at least this many query tiles of ``TILE_ROWS`` rows per processor (an SM on
#: CUDA, a thread elsewhere), so that the device runs full waves as it does on the whole call.
TILES_PER_UNIT = 4
TILE_ROWS = 128


def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def timed_part(q, k, v, mask, layout: str) -> tuple[tuple, float]:
    """((q, k, v, mask), share): the part of the call candidates are timed on, as views of the
    caller's tensors, and the share of the call's work it is. The whole call (share 1) up to
    ``TIMED_WORK``; above it the first batch items and heads whose work is about ``TIMED_WORK``, at
    the call's full lengths, and never fewer heads than keep the device full."""
    bq = q.transpose(1, 2) if layout == "bshd" else q
    b, h, n, d = bq.shape
    kv = k.shape[1] if layout == "bshd" else k.shape[2]
    per_head = attention_flops(1, 1, n, kv, d)
    limit = TIMED_WORK.get(q.device.type, TIMED_WORK["cpu"])
    if b * h * per_head <= limit:
        return (q, k, v, mask), 1.0
    full = -(-_processors(q.device) * TILES_PER_UNIT // -(-n // TILE_ROWS))
    units = min(b * h, max(1, full, int(limit // per_head)))
    batch, heads = (1, units) if units <= h else (-(-units // h), h)
    return _check.part(q, k, v, mask, layout, batch, heads, n, kv), batch * heads / (b * h)


def measure(candidates: list, q, k, v, mask, scale, layout: str) -> Ranking:
    """Check and time every candidate on this call (see the module's docstring for the bounds)."""
    timer = _Timer(q.device)
    samples, rejected, first = {}, {}, {}
    with torch.no_grad():
        probe = _check.probe(q, k, v, mask, layout)
        part, share = timed_part(q, k, v, mask, layout)
        rows = _check.samples(part[0], layout)
        ref = _check.reference(*part, scale, layout, rows)
        calls = {c.id: (lambda run=c.run: run(*part, scale)) for c in candidates}

        def checked(fn, limit: float) -> tuple[str, float]:
            """A run of ``fn`` on the timed part (or the whole probe): its verdict and its time."""
            timer.sync()
            t0 = time.perf_counter()
            out = fn()
            timer.sync()
            return _check.check(out, part[0].shape, layout, rows, ref, limit), time.perf_counter() - t0

        for c in candidates:  # the checked call, which also warms the kernel up
            limit = _check.bound(c.dtype, q.device.type, c.approximate)
            try:
                if not probe.untouched():  # the last candidate wrote into the copies
                    probe = probe.renewed()
                if probe.whole:
                    reason, t = checked(lambda: c.run(*probe.args, scale), limit)
                else:
                    c.run(*probe.args, scale)
                if not probe.untouched():
                    reason = f"{_check.CHECK_FAILED}: {_check.WROTE_INPUTS}"
                elif not probe.whole:
                    # On the caller's tensors, now that the probe saw it leave its inputs alone.
                    before = _check.checksums(*part[:3])
                    reason, t = checked(calls[c.id], limit)
                    if _check.changed(before, *part[:3]):
                        reason = f"{_check.CHECK_FAILED}: {_check.WROTE_AT_FULL_SIZE}"
                        ref = _check.reference(*part, scale, layout, rows)  # what the others now see
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a reason, as at run time
                if is_sticky(exc):
                    raise
                reason = failure_text(exc)
            if reason:
                rejected[c.id] = reason
            else:
                first[c.id] = t
        _race(first, samples, rejected, calls, timer)
    # A part's time stands for the whole call's: time grows with batch x heads once the device is full.
    timings = {bid: _median(ts) / share for bid, ts in samples.items() if ts}
    ordered = dict(sorted(timings.items(), key=lambda item: item[1]))
    return Ranking("measured", ordered, rejected, not any("out of memory" in r.lower() for r in rejected.values()))


def _race(first: dict, samples: dict, rejected: dict, calls: dict, timer: _Timer) -> None:
    """Time the candidates that passed their checked call (``first``: its time), into ``samples``."""

    def timed(bid: str, n: int) -> None:
        try:
            samples[bid] += timer.times(calls[bid], n)
        except Exception as exc:  # noqa: BLE001 - as in measure
            if is_sticky(exc):
                raise
            del samples[bid]
            rejected[bid] = failure_text(exc)

    if not first:
        return
    fastest = min(first.values())
    for bid, t in first.items():
        samples[bid] = []
        if bid != min(first, key=first.get) and (t > SLOWER * fastest or (t > BUDGET_S and t > fastest)):
            # Clearly slower, even counting its one-time costs: the checked call is its time.
            samples[bid] = [t]
    # Rounds over the candidates still in the race, so that drift affects them alike.
    racing = [bid for bid in first if not samples[bid]]
    for bid in racing:
        timed(bid, 1)
    racing = [bid for bid in racing if bid in samples]
    if racing:
        best = min(samples[bid][0] for bid in racing)
        racing = [bid for bid in racing if samples[bid][0] <= min(SLOWER * best, BUDGET_S)]
        round_s = sum(samples[bid][0] for bid in racing)
        for _ in range(min(REPS - 2, int(BUDGET_S / max(round_s, 1e-9)))):
            for bid in racing:
                if bid in samples:
                    timed(bid, 1)


def rank(spec, fp32: str, candidates: list, inputs: tuple | None) -> Ranking | None:
    """The ranking of ``candidates`` for a call: stored when the file has every candidate of this
    signature on this machine; else measured on ``inputs`` (q, k, v, mask, scale) and stored; None
    when nothing is stored and ``inputs`` is None (``explain`` runs no kernel)."""
    fp = fingerprint(spec.device)
    key, sig = fingerprint_key(fp), signature(spec, fp32)
    ids = [c.id for c in candidates]
    with _lock:
        entry = _store.entry(key, sig)
        if entry is not None and all(i in entry["timings"] or i in entry["rejected"] for i in ids):
            timings = {i: float(t) for i, t in sorted(entry["timings"].items(), key=lambda item: item[1]) if i in ids}
            return Ranking("stored", timings, {i: str(r) for i, r in entry["rejected"].items() if i in ids})
        if inputs is None:
            return None
        try:
            ranking = measure(candidates, *inputs, layout=spec.layout)
        except Exception as exc:  # noqa: BLE001 - e.g. no memory left for the reference: never break a call
            if is_sticky(exc):
                raise
            log.warning("attention tuning: could not measure %s (%s); the fixed order serves it", sig,
                        failure_text(exc))
            return None
        new = {"call": call_fields(spec, fp32), "timings": dict(entry["timings"]) if entry else {},
               "rejected": dict(entry["rejected"]) if entry else {}}
        for i in ids:
            new["timings"].pop(i, None)
            new["rejected"].pop(i, None)
        new["timings"].update(ranking.timings)
        new["rejected"].update(ranking.rejected)
        new["winner"] = min(new["timings"], key=new["timings"].get) if new["timings"] else None
        new["measured"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if ranking.keep:
            _store.put(key, fp, sig, new)
    log.info("attention tuning: %s: %s", sig, ", ".join(
        [f"{i} {ms_text(t)}" for i, t in ranking.timings.items()]
        + [f"{i} rejected ({r})" for i, r in ranking.rejected.items()]))
    return ranking
