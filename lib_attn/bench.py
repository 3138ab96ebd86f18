"""``python -m lib_attn bench``: time every backend on the attention calls of real models.

For each model's calls (``lib_attn.shapes``) and every backend column ("auto" =
the engine's current configuration with tuning on unless ``--tune off``, so it
runs what tuning ranks fastest; then each backend id pinned per call):

* time per call: median and p20/p80 over samples taken in interleaved rounds
  (the backend order rotates every round so clock and thermal drift cancel);
  CUDA events on a GPU, ``time.perf_counter_ns`` on the CPU;
* TFLOP/s (``4·b·h·q·kv·d``), attention time per denoising step weighted by calls
  per step, and % of the H200 floor when the device is an H200;
* peak extra memory of one call: on CUDA the allocator's peak over the allocation
  before the call; on CPU the resident-set high-water mark (Linux
  ``/proc/self/clear_refs``) over the resident set before the call, in a fresh
  subprocess whose glibc returns every block ≥ 64 KiB to the OS on free;
* error against a float64 reference on evenly spaced query rows;
* which backend really ran (from the engine's recording) and, for a backend that
  cannot take a call, the engine's reasons instead of a number.

Inputs are laid out as A1111 passes them: ``(b, s, h·d)`` projections viewed as
``(b, s, h, d)`` and transposed to ``(b, h, s, d)``, i.e. non-contiguous.
"""
from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import shapes, tune
from lib_attn.device import miopen_text
from lib_attn.doctor import environment, shown

SCHEMA = "lib_attn.bench/1"

DTYPES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
# What the hosts usually run on a GPU: fp16 UNets and VAEs, bf16 DiTs.
GPU_DEFAULT_DTYPE = {"unet": "fp16", "vae": "fp16", "dit": "bf16"}
AUTO = "auto"
ERROR_ROWS = 256
OVERHEAD_SHAPE = (2, 8, 64, 77, 160)  # b, h, q, kv, d: SD1.5's smallest cross-attention
TINY_SHAPE = (1, 1, 16, 16, 64)
MIB = 1024 * 1024
GPU_WARMUP_S = 0.025
# On the CPU a call this slow counts its first (verification) run as one of its samples: one-time
# costs are a small part of it, and a median over three or more samples ignores one slow run.
FIRST_RUN_SAMPLE_S = 0.25


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(sorted(DTYPES))}; got {name!r}") from None


# ------------------------------------------------------------------ statistics


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolated quantile of already sorted values (p in [0, 1])."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = p * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_s: Sequence[float]) -> Dict[str, float]:
    s = sorted(samples_s)
    return {"median_us": quantile(s, 0.5) * 1e6, "p20_us": quantile(s, 0.2) * 1e6,
            "p80_us": quantile(s, 0.8) * 1e6, "samples": len(s)}


# ------------------------------------------------------------------ inputs


def make_inputs(call: shapes.AttentionCall, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``call`` as non-contiguous (b, h, s, d) views of (b, s, h·d) projections."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def proj(seq: int) -> torch.Tensor:
        x = torch.randn(call.b, seq, call.heads * call.head_dim, generator=gen, dtype=torch.float32)
        x = x.to(device=device, dtype=dtype)
        return x.view(call.b, seq, call.heads, call.head_dim).transpose(1, 2)

    return proj(call.q_len), proj(call.kv_len), proj(call.kv_len)


def sample_rows(q_len: int, n: int = ERROR_ROWS) -> torch.Tensor:
    """Evenly spaced query rows, first and last included (all rows when q_len ≤ n)."""
    if q_len <= n:
        return torch.arange(q_len)
    return torch.linspace(0, q_len - 1, n).round().long().unique()


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """float64 softmax(q kᵀ/√d) v for the given query rows, on q's device."""
    qd = q[:, :, rows.to(q.device), :].double()
    scores = (qd @ k.double().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return scores.softmax(dim=-1) @ v.double()


def output_error(out: torch.Tensor, rows: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(relative L2 error, max abs error) of ``out`` on ``rows`` against ``ref``."""
    diff = out[:, :, rows.to(out.device), :].double() - ref
    rel = (diff.norm() / ref.norm()).item()
    return rel, diff.abs().max().item()


# ------------------------------------------------------------------ timing


class Timer:
    """Per-call times: CUDA events on a GPU, perf_counter_ns on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.method = "cuda-events" if self.cuda else "perf_counter_ns"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], object], n: int) -> Tuple[List[float], float]:
        """Run ``fn`` n times; return the per-call seconds and the wall seconds per call
        (launch-inclusive on a GPU: from the first launch to the end of the last kernel)."""
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n)]
            self.sync()
            t0 = time.perf_counter_ns()
            for start, end in events:
                start.record()
                fn()
                end.record()
            self.sync()
            wall = (time.perf_counter_ns() - t0) * 1e-9 / n
            return [s.elapsed_time(e) * 1e-3 for s, e in events], wall
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) * 1e-9)
        return times, sum(times) / n


# ------------------------------------------------------------------ progress


class Progress:
    """A one-line bar on stderr when it is a terminal; a line per 10% otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.last_decile = -1

    def step(self, label: str, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.monotonic() - self.t0
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {elapsed:5.0f}s {label[:40]:<40}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(f"bench: {frac:4.0%} after {elapsed:.0f}s ({label})\n")
            self.stream.flush()


# ------------------------------------------------------------------ cells


@dataclass
class Cell:
    """One backend column on one call, in one dtype."""

    model: str
    res: int
    dtype: str
    where: str
    backend: str
    status: str = "ok"  # ok | unsupported | fell back | failed
    reason: str = ""
    ran: str = ""  # backend id that really ran (from the recording)
    kernel: str = ""  # the engine's description of the kernel that ran
    cast: Optional[str] = None
    tuned: str = ""  # auto: how the engine chose ("measured", "stored", "order")
    timings_us: Optional[Dict[str, float]] = None  # auto, tuned: each candidate's median from tuning
    median_us: Optional[float] = None
    p20_us: Optional[float] = None
    p80_us: Optional[float] = None
    samples: int = 0
    wall_us: Optional[float] = None
    tflops: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    rel_l2_error: Optional[float] = None
    max_abs_error: Optional[float] = None
    h200_floor_pct: Optional[float] = None
    memory_error: str = ""
    _times: List[float] = field(default_factory=list, repr=False)
    _walls: List[float] = field(default_factory=list, repr=False)

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _reasons_for(decision, backend: str) -> List[str]:
    for bid, reasons in getattr(decision, "rejected", []) or []:
        if bid == backend:
            return list(reasons)
    return []


def _kernel_text(rec, bid: str) -> str:
    kernels = getattr(rec, "kernels", None) or {}
    return str(kernels.get(bid, "")) if bid else ""


def _ran(rec, role: str) -> Tuple[str, str]:
    """(backend id(s) that ran, fallback reasons) from a recording."""
    ran = sorted({bid for (r, bid), n in rec.calls.items() if r == role and n})
    falls = sorted({f"{bid}: {reason}" for (r, bid, reason), n in rec.fallbacks.items()
                    if r == role and n})
    return ",".join(ran), "; ".join(falls)


def _load_average() -> Optional[List[float]]:
    """1, 5 and 15 minute load averages, where the OS has them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


class OtherLoad:
    """CPU time the rest of the machine used while the benchmark ran (Linux /proc/stat less this
    process and its children), as a share of all CPUs: the timings' interference."""

    def __init__(self):
        self.start = self._sample()
        self.t0 = time.monotonic()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float]]:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        busy = (user + nice + system + irq + softirq + steal) / ticks
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system

    def share(self) -> Optional[float]:
        end = self._sample()
        wall = time.monotonic() - self.t0
        if self.start is None or end is None or wall <= 0:
            return None
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(others, 0.0) / (wall * (os.cpu_count() or 1))


def _is_h200(env: dict) -> bool:
    return "H200" in (env.get("device") or {}).get("name", "")


# ------------------------------------------------------------------ memory


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def cpu_peak_supported() -> bool:
    try:
        _reset_rss_peak()
        _status_kib("VmHWM")
        return True
    except (OSError, KeyError):
        return False


CPU_MEMORY_METHOD = ("RSS high-water mark (/proc/self/clear_refs + VmHWM) over RSS before the call, "
                     "one call per cell in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536; "
                     "output tensor included")
CUDA_MEMORY_METHOD = ("torch.cuda max_memory_allocated after reset_peak_memory_stats, over "
                      "memory_allocated before the call; output tensor included")


def _memory_worker() -> None:
    """Subprocess entry: cells as JSON on stdin; one JSON line per cell on stdout."""
    spec = json.load(sys.stdin)
    torch.set_num_threads(spec["threads"])
    lib_attn.configure(tune=spec.get("tune", "auto"))  # the parent's rankings, read from the tuning file
    cpu = torch.device("cpu")
    warmed = set()
    for cell in spec["cells"]:
        call = shapes.AttentionCall(**cell["call"])
        dtype = parse_dtype(cell["dtype"])
        backend = cell["backend"]
        try:
            key = (backend, cell["dtype"], call.head_dim, call.role)
            if key not in warmed:  # one-time lazy initialisation is not per-call memory
                tiny = shapes.AttentionCall(call.model, call.res, "warm-up", "self", call.role,
                                            1, 1, 64, 64, call.head_dim, 1)
                lib_attn.attention(*make_inputs(tiny, dtype, cpu), role=call.role, backend=backend)
                warmed.add(key)
            q, k, v = make_inputs(call, dtype, cpu)
            gc.collect()
            before = _status_kib("VmRSS")
            _reset_rss_peak()
            out = lib_attn.attention(q, k, v, role=call.role, backend=backend)
            peak = _status_kib("VmHWM")
            del out, q, k, v
            result = {"peak_extra_bytes": max(peak - before, 0) * 1024}
        except (RuntimeError, ValueError, MemoryError) as exc:
            result = {"error": _first_line(exc)}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def measure_cpu_memory(jobs: List[Tuple[shapes.AttentionCall, str, Optional[str]]],
                       on_result: Optional[Callable[[int], None]] = None) -> List[dict]:
    """Peak extra bytes of one call per job ``(call, dtype name, backend or None)``, measured in
    a fresh subprocess (see ``CPU_MEMORY_METHOD``)."""
    if not jobs:
        return []
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(lib_attn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks leave the resident set at once
    payload = {"threads": torch.get_num_threads(), "tune": lib_attn.config().tune,
               "cells": [{"call": asdict(c), "dtype": d, "backend": b} for c, d, b in jobs]}
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen([sys.executable, "-c", "from lib_attn.bench import _memory_worker; "
                                 "_memory_worker()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, text=True, env=env)
        proc.stdin.write(json.dumps(payload))
        proc.stdin.close()
        results: List[dict] = []
        for line in proc.stdout:
            results.append(json.loads(line))
            if on_result:
                on_result(len(results) - 1)
        proc.wait()
        errors.seek(0)
        err = errors.read()
    if len(results) < len(jobs):
        tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        results += [{"error": f"memory subprocess failed: {tail}"}] * (len(jobs) - len(results))
    return results


# ------------------------------------------------------------------ overhead


def measure_overhead(device: torch.device, dtype: torch.dtype, shape=OVERHEAD_SHAPE,
                     rounds: int = 300, inner: int = 5, backend: Optional[str] = None) -> dict:
    """Time ``lib_attn.attention`` (current configuration) against a direct
    ``F.scaled_dot_product_attention`` call on the same contiguous inputs.

    Blocks of ``inner`` calls alternate between the two (order swapped every round);
    ``added_us`` is the median of the per-round differences (engine - direct) and
    ``added_min_us`` the difference of the fastest blocks, which load on a shared
    machine disturbs less. The comparison is like for like only when the engine
    picked PyTorch's own choice (``engine_backend`` "sdpa"); ``backend`` pins one.
    """
    b, h, q_len, kv_len, d = shape
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device=device, dtype=dtype)
               for n in (q_len, kv_len, kv_len))
    timer = Timer(device)

    def direct():
        return F.scaled_dot_product_attention(q, k, v)

    def engine():
        return lib_attn.attention(q, k, v, role="unet", backend=backend)

    picked = lib_attn.explain(q, k, v, role="unet", backend=backend).backend
    for _ in range(max(10, inner * 2)):
        direct()
        engine()
    timer.sync()
    per_call: Dict[str, List[float]] = {"direct": [], "engine": []}
    diffs = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            got = {}
            for name in (("direct", "engine") if r % 2 == 0 else ("engine", "direct")):
                fn = direct if name == "direct" else engine
                timer.sync()
                t0 = time.perf_counter_ns()
                for _ in range(inner):
                    fn()
                timer.sync()
                got[name] = (time.perf_counter_ns() - t0) * 1e-9 / inner
                per_call[name].append(got[name])
            diffs.append(got["engine"] - got["direct"])
    finally:
        if gc_was:
            gc.enable()
    sd = sorted(diffs)
    return {
        "shape": {"b": b, "heads": h, "q_len": q_len, "kv_len": kv_len, "head_dim": d},
        "dtype": dtype_name(dtype), "device": str(device),
        "engine_backend": picked, "pinned": backend, "like_for_like": picked == "sdpa",
        "direct_us": summarize(per_call["direct"])["median_us"],
        "engine_us": summarize(per_call["engine"])["median_us"],
        "added_us": quantile(sd, 0.5) * 1e6,
        "added_p20_us": quantile(sd, 0.2) * 1e6,
        "added_p80_us": quantile(sd, 0.8) * 1e6,
        "added_min_us": (min(per_call["engine"]) - min(per_call["direct"])) * 1e6,
        "rounds": rounds, "calls_per_block": inner,
    }


def dispatch_cost(device: torch.device, dtype: torch.dtype, calls: int = 20000, repeats: int = 15) -> dict:
    """The engine's own per-call cost with the kernel taken out: ``lib_attn.attention`` on a cached
    decision whose kernel call is a no-op, against calling that no-op directly. Unlike the
    timings above, no kernel's run-to-run noise hides it; best of ``repeats`` blocks."""
    from . import dispatch

    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    lib_attn.attention(q, q, q)
    decision = dispatch._cache[dispatch._key(q, q, q, None, "bhsd", "unet", None, None)]
    kernel = decision.run

    def noop(q, k, v, mask, scale):
        return q

    def block(fn) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(q, q, q)
        return (time.perf_counter_ns() - t0) * 1e-3 / calls

    decision.run = noop
    try:
        engine = min(block(lib_attn.attention) for _ in range(repeats))
        direct = min(block(lambda a, b, c: noop(a, b, c, None, None)) for _ in range(repeats))
    finally:
        decision.run = kernel
    return {"engine_us": engine, "direct_us": direct, "added_us": engine - direct, "calls": calls}


def engine_overhead(device: torch.device, dtype: torch.dtype, rounds: int = 200) -> dict:
    """The engine's added time per call at SD1.5's smallest cross-attention (the budget's
    shape) and at a tiny call, where the kernel's own noise hides less of it."""
    # On the CPU the kernels run on one thread here: the engine's cost is Python on the calling
    # thread either way, and a multi-threaded kernel on a shared machine stalls at its barriers
    # for milliseconds, which would bury a microsecond difference.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        result = {
            "method": "wall clock per block of calls (synchronised on CUDA); blocks alternate direct "
                      "F.scaled_dot_product_attention / lib_attn.attention on the same inputs; added "
                      "= median of per-round differences",
            "budget_us": 2.0,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "sd15_cross_mid": measure_overhead(device, dtype, OVERHEAD_SHAPE, rounds=rounds, inner=5),
            "tiny": measure_overhead(device, dtype, TINY_SHAPE, rounds=rounds, inner=20),
            "dispatch": dispatch_cost(device, dtype),
        }
        if not result["sd15_cross_mid"]["like_for_like"]:
            # The configuration runs another kernel than PyTorch would: pin PyTorch's choice too,
            # so one number compares the same kernel.
            result["sd15_cross_mid_sdpa"] = measure_overhead(device, dtype, OVERHEAD_SHAPE,
                                                             rounds=rounds, inner=5, backend="sdpa")
    finally:
        torch.set_num_threads(threads)
    return result


# ------------------------------------------------------------------ the run


@dataclass
class BenchSettings:
    models: List[str]
    res: Optional[int] = None
    dtypes: Optional[List[str]] = None  # None: fp32 on CPU, per-role default on CUDA
    backends: Optional[List[str]] = None  # None: auto + every available backend
    device: Optional[str] = None
    budget_s: Optional[float] = None  # timed seconds per call row (all columns)
    min_rounds: int = 3
    max_samples: int = 100
    overhead: bool = True
    overhead_rounds: int = 200
    memory: bool = True
    progress: bool = True
    seed: int = 0
    tune: str = "on"  # the auto column's tuning mode


def resolve_columns(requested: Optional[List[str]]) -> Tuple[List[str], Dict[str, str]]:
    """Backend columns and, for unavailable ones, the reason. Validates ids."""
    infos = {i.id: i for i in lib_attn.backends()}
    valid = (AUTO,) + tuple(lib_attn.BACKEND_IDS)
    if requested is None:
        cols = [AUTO] + [i.id for i in lib_attn.backends() if i.available]
    else:
        cols = []
        for name in requested:
            if name not in valid:
                raise ValueError(f"backends must be among {', '.join(valid)}; got {name!r}")
            if name not in cols:
                cols.append(name)
    unavailable = {c: f"not available: {infos[c].reason}" for c in cols
                   if c != AUTO and c in infos and not infos[c].available}
    return cols, unavailable


def _dtype_for(call: shapes.AttentionCall, settings: BenchSettings, device: torch.device) -> List[str]:
    if settings.dtypes:
        return [dtype_name(parse_dtype(d)) for d in settings.dtypes]
    if device.type == "cuda":
        return [dtype_name(parse_dtype(GPU_DEFAULT_DTYPE[call.role]))]
    return ["float32"]


def _prepare(cell: Cell, call, q, k, v, rows, ref, unavailable: Dict[str, str],
             timer: Timer) -> Tuple[Optional[Callable[[], object]], float]:
    """Decide, warm up and verify one cell.

    Returns its call (None when it cannot run) and the seconds one call takes, to size the rounds.
    """
    if cell.backend in unavailable:
        cell.status, cell.reason = "unsupported", unavailable[cell.backend]
        return None, 0.0
    pinned = None if cell.backend == AUTO else cell.backend
    decision = lib_attn.explain(q, k, v, role=call.role, backend=pinned)
    cast = getattr(decision, "cast", None)
    cell.cast = dtype_name(cast) if isinstance(cast, torch.dtype) else (str(cast) if cast else None)
    if pinned is not None and decision.backend != pinned:
        cell.status = "unsupported"
        cell.reason = "; ".join(_reasons_for(decision, pinned)) or f"engine picks {decision.backend}"
        return None, 0.0

    def fn():
        return lib_attn.attention(q, k, v, role=call.role, backend=pinned)

    try:
        if pinned is None:
            fn()  # the call kind's first call: tuning measures here, outside every sample
            decision = lib_attn.explain(q, k, v, role=call.role)
            cell.tuned = decision.source
            cell.timings_us = {b: t * 1e6 for b, t in decision.timings.items()} or None
        with lib_attn.recording() as rec:
            t0 = time.perf_counter()
            out = fn()
            timer.sync()
            first = time.perf_counter() - t0
        cell.ran, falls = _ran(rec, call.role)
        cell.kernel = _kernel_text(rec, cell.ran)
        if pinned is not None and cell.ran != pinned:
            cell.status, cell.reason = "fell back", falls or f"{cell.ran} ran instead"
            return None, 0.0
        cell.rel_l2_error, cell.max_abs_error = output_error(out, rows, ref)
        del out
        if not timer.cuda:
            return fn, first
        gc.collect()
        torch.cuda.reset_peak_memory_stats(timer.device)
        before = torch.cuda.memory_allocated(timer.device)
        out = fn()
        timer.sync()
        cell.peak_extra_mib = (torch.cuda.max_memory_allocated(timer.device) - before) / MIB
        del out
        # Warm up by time, so autotuning and lazy initialisation stay out of the samples.
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < GPU_WARMUP_S:
            fn()
            n += 1
            if n % 8 == 0 or n <= 3:
                timer.sync()
        timer.sync()
        return fn, (time.perf_counter() - t0) / n
    except (RuntimeError, ValueError) as exc:
        cell.status, cell.reason = "failed", _first_line(exc)
        return None, 0.0


def _plan_rounds(estimates: List[float], budget: float, settings: BenchSettings) -> Tuple[int, int]:
    """(rounds, calls per round) so that a row's timed work is about ``budget`` seconds."""
    total = max(sum(estimates), 1e-6)
    samples = int(min(settings.max_samples, max(settings.min_rounds, budget / total)))
    rounds = max(settings.min_rounds, min(samples, 10))
    return rounds, max(1, math.ceil(samples / rounds))


def run(settings: BenchSettings) -> dict:
    """Run the benchmark and return the result document (see ``SCHEMA``)."""
    with lib_attn.use(tune=settings.tune):
        return _run(settings)


def _run(settings: BenchSettings) -> dict:
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    columns, unavailable = resolve_columns(settings.backends)
    timer = Timer(device)
    budget = settings.budget_s if settings.budget_s is not None else (1.5 if device.type == "cpu" else 0.4)

    rows_calls = []  # (call, dtype name)
    for model in settings.models:
        for call in shapes.model_calls(model, settings.res):
            for dt in _dtype_for(call, settings, device):
                rows_calls.append((call, dt))

    n_cells = len(rows_calls) * len(columns)
    cpu_memory = settings.memory and device.type == "cpu" and cpu_peak_supported()
    # Progress units: one per cell prepared, one per cell and round timed (rounds are known per
    # row once its cells are warm, so the total grows), one per memory measurement, one for overhead.
    progress = Progress(n_cells * (1 + settings.min_rounds) + (n_cells if cpu_memory else 0)
                        + (1 if settings.overhead else 0), enabled=settings.progress)
    cells: List[Cell] = []
    t_start = time.monotonic()
    load_start = _load_average()
    other_load = OtherLoad()
    for call, dt in rows_calls:
        dtype = parse_dtype(dt)
        q, k, v = make_inputs(call, dtype, device, seed=settings.seed)
        rows = sample_rows(call.q_len)
        ref = reference_rows(q, k, v, rows)
        row_cells, runnable, estimates = [], [], []
        for col in columns:
            cell = Cell(call.model, call.res, dt, call.where, col)
            fn, est = _prepare(cell, call, q, k, v, rows, ref, unavailable, timer)
            progress.step(f"{call.model} {call.where} {col}")
            row_cells.append(cell)
            if fn is not None:
                runnable.append((cell, fn))
                estimates.append(est)
                if not timer.cuda and est >= FIRST_RUN_SAMPLE_S:
                    cell._times.append(est)
                    cell._walls.append(est)
        rounds, inner = _plan_rounds(estimates, budget, settings)
        progress.total += len(runnable) * rounds - len(columns) * settings.min_rounds
        _time_row(runnable, timer, rounds, inner, progress, call)
        for cell in row_cells:
            _finish_cell(cell, call, env)
        cells.extend(row_cells)
        del q, k, v, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()

    memory_method = None
    if settings.memory:
        if device.type == "cuda":
            memory_method = CUDA_MEMORY_METHOD
        elif cpu_memory:
            memory_method = CPU_MEMORY_METHOD
            ok = [c for c in cells if c.status == "ok"]
            progress.total += len(ok) - n_cells
            call_of = {(call.model, call.where): call for call, _ in rows_calls}
            jobs = [(call_of[(c.model, c.where)], c.dtype, None if c.backend == AUTO else c.backend)
                    for c in ok]
            results = measure_cpu_memory(jobs, on_result=lambda i: progress.step(
                f"memory {ok[i].model} {ok[i].where} {ok[i].backend}"))
            for c, res in zip(ok, results):
                if "peak_extra_bytes" in res:
                    c.peak_extra_mib = res["peak_extra_bytes"] / MIB
                else:
                    c.memory_error = res.get("error", "")
        else:
            memory_method = "unavailable: needs Linux /proc/self/clear_refs"

    overhead = None
    if settings.overhead:
        ov_dtype = torch.float32 if device.type == "cpu" else torch.float16
        overhead = engine_overhead(device, ov_dtype, settings.overhead_rounds)
        progress.step("engine overhead")

    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [os.path.basename(sys.executable), "-m", "lib_attn"] + sys.argv[1:],
        "versions": env["versions"],
        "device": env["device"],
        "settings": {
            "models": settings.models, "res": settings.res,
            "dtypes": sorted({dt for _, dt in rows_calls}), "columns": columns,
            "timer": timer.method, "budget_s_per_row": budget, "min_rounds": settings.min_rounds,
            "max_samples": settings.max_samples, "memory_method": memory_method,
            "tune": settings.tune, "tuning_file": tune.cache_path(),
            "first_run_is_a_sample_above_s": None if timer.cuda else FIRST_RUN_SAMPLE_S,
            "reference": f"float64 softmax(QKᵀ/√d)V on up to {ERROR_ROWS} evenly spaced query rows",
            "inputs": "A1111 layout: (b, s, h·d) viewed (b, s, h, d) and transposed to (b, h, s, d)",
            "h200_floor": _is_h200(env),
            "seconds": round(time.monotonic() - t_start, 2),
            "cpu_count": os.cpu_count(),
            "load_average": {"start": load_start, "end": _load_average()},
            "other_processes_cpu_share": other_load.share(),
        },
        "backends": env["backends"],
        "calls": [dict(asdict(call), gflop=call.flops / 1e9, dtype=dt) for call, dt in rows_calls],
        "results": [c.public() for c in cells],
        "per_step": per_step(rows_calls, cells, columns),
        "overhead": overhead,
    }


def _time_row(runnable, timer: Timer, rounds: int, inner: int, progress: Progress, call) -> None:
    """Interleaved rounds over a row's runnable cells; the order rotates every round."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % max(len(runnable), 1)
            for cell, fn in runnable[shift:] + runnable[:shift]:
                if cell.status == "ok" and len(cell._times) < rounds * inner:
                    try:
                        times, wall = timer.run(fn, inner)
                        cell._times.extend(times)
                        cell._walls.append(wall)
                    except (RuntimeError, ValueError) as exc:
                        cell.status, cell.reason = "failed", _first_line(exc)
                progress.step(f"{call.model} {call.where} {cell.backend} round {r + 1}/{rounds}")
    finally:
        if gc_was:
            gc.enable()


def _finish_cell(cell: Cell, call: shapes.AttentionCall, env: dict) -> None:
    if cell.status != "ok" or not cell._times:
        cell._times = []
        return
    stats = summarize(cell._times)
    cell.median_us, cell.p20_us, cell.p80_us = stats["median_us"], stats["p20_us"], stats["p80_us"]
    cell.samples = stats["samples"]
    cell.wall_us = quantile(sorted(cell._walls), 0.5) * 1e6
    cell.tflops = call.flops / (cell.median_us * 1e-6) / 1e12
    if _is_h200(env) and cell.dtype in ("float16", "bfloat16"):
        cell.h200_floor_pct = 100.0 * shapes.h200_floor_s(*call.shape) / (cell.median_us * 1e-6)
    cell._times, cell._walls = [], []


def per_step(rows_calls, cells: List[Cell], columns: List[str]) -> List[dict]:
    """Attention ms per denoising step (per decode for the VAE) per model, dtype and column."""
    out = []
    groups: Dict[Tuple[str, int, str], List[shapes.AttentionCall]] = {}
    for call, dt in rows_calls:
        groups.setdefault((call.model, call.res, dt), []).append(call)
    index = {(c.model, c.res, c.dtype, c.where, c.backend): c for c in cells}
    for (model, res, dt), calls in groups.items():
        flops = sum(c.step_flops for c in calls)
        for col in columns:
            total, missing = 0.0, []
            for call in calls:
                cell = index[(model, res, dt, call.where, col)]
                if cell.status == "ok" and cell.median_us is not None:
                    total += cell.median_us * call.calls
                else:
                    missing.append(call.where)
            ms = None if missing else total / 1e3
            out.append({"model": model, "res": res, "dtype": dt, "backend": col,
                        "unit": "decode" if model == "vae" else "step",
                        "calls": sum(c.calls for c in calls), "gflop": flops / 1e9,
                        "ms": ms, "tflops": (flops / (ms * 1e-3) / 1e12) if ms else None,
                        "missing": missing})
    return out


# ------------------------------------------------------------------ output


def format_table(headers: List[str], rows: List[List[str]], right_from: int = 1) -> str:
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]

    def line(r):
        return "  ".join(str(x).rjust(w) if i >= right_from else str(x).ljust(w)
                         for i, (x, w) in enumerate(zip(r, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def fmt_time(us: Optional[float]) -> str:
    if us is None:
        return "-"
    if us >= 1e5:
        return f"{us / 1e3:.0f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"


def fmt_spread(cell: dict) -> str:
    med = cell["median_us"]
    half = (cell["p80_us"] - cell["p20_us"]) / 2
    return f"{fmt_time(med)} ±{100 * half / med:.0f}%"


def fmt_sig(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 else f"{x:.1e}"


class Footnotes:
    """Numbered reasons, so a table cell stays short and each reason is printed once."""

    def __init__(self):
        self.items: List[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"

    def render(self) -> str:
        return "\n".join(f"  [{i + 1}] {t}" for i, t in enumerate(self.items))


def _na(cell: dict, notes: Footnotes) -> str:
    tag = {"unsupported": "n/a", "fell back": "fell back", "failed": "failed"}[cell["status"]]
    return f"{tag}{notes.ref(cell['backend'] + ': ' + cell['reason'])}"


def render(doc: dict) -> str:
    """The stdout report: one block per model and dtype."""
    out = []
    dev = doc["device"]
    v = doc["versions"]
    out.append(f"lib_attn bench: {dev['description']}; torch {v['torch']}"
               + (f", CUDA {v['cuda']}, cuDNN {shown(v.get('cudnn'))}" if v.get("cuda") else "")
               + (f", HIP {v['hip']}, MIOpen {miopen_text(v.get('miopen'))}" if v.get("hip") else "")
               + f"; timer {doc['settings']['timer']}")
    if AUTO in doc["settings"]["columns"]:
        tuned = doc["settings"].get("tune", "auto")
        out.append("auto: " + ("tuned: the engine measured (or read from "
                               f"{doc['settings'].get('tuning_file')}) each call kind's candidates and runs the "
                               "fastest correct one; 'auto ran' says measured or stored" if tuned == "on" else
                               f"tuning {tuned}: the engine's fixed order"))
    results = doc["results"]
    columns = doc["settings"]["columns"]
    h200 = doc["settings"]["h200_floor"]
    calls_by_model: Dict[Tuple[str, int, str], List[dict]] = {}
    for c in doc["calls"]:
        calls_by_model.setdefault((c["model"], c["res"], c["dtype"]), []).append(c)
    index = {(r["model"], r["res"], r["dtype"], r["where"], r["backend"]): r for r in results}
    steps = {(s["model"], s["res"], s["dtype"], s["backend"]): s for s in doc["per_step"]}
    for (model, res, dt), calls in calls_by_model.items():
        notes = Footnotes()
        unit = "decode" if model == "vae" else "step"
        out.append("")
        out.append(f"{shapes.MODEL_LABELS[model]} @ {res}, {dt}: time per call, median ±(p80-p20)/2")
        base = ["call", "b,h,q,kv,d", f"×/{unit}", "GFLOP"]
        rows = []
        for c in calls:
            shape = f"{c['b']},{c['heads']},{c['q_len']},{c['kv_len']},{c['head_dim']}"
            row = [c["where"], shape, str(c["calls"]), fmt_sig(c["gflop"])]
            for col in columns:
                cell = index[(model, res, dt, c["where"], col)]
                row.append(fmt_spread(cell) if cell["status"] == "ok" else _na(cell, notes))
            auto = index.get((model, res, dt, c["where"], AUTO))
            tuned = f" ({auto.get('tuned')})" if auto and auto.get("tuned") not in (None, "", "order") else ""
            row.append(auto["ran"] + tuned if auto and auto["ran"] else "-")
            rows.append(row)
        step_row = [f"ms per {unit}", "", "", ""]
        tput_row = ["TFLOP/s", "", "", ""]
        for col in columns:
            s = steps[(model, res, dt, col)]
            step_row.append(f"{s['ms']:.2f}" if s["ms"] is not None else "incomplete")
            tput_row.append(fmt_sig(s["tflops"]))
        rows += [step_row + [""], tput_row + [""]]
        out.append(format_table(base + columns + ["auto ran"], rows, right_from=2))

        def metric_table(title: str, key: str, fmt) -> None:
            mrows = []
            for c in calls:
                row = [c["where"]]
                for col in columns:
                    cell = index[(model, res, dt, c["where"], col)]
                    row.append(fmt(cell[key]) if cell["status"] == "ok" else "-")
                mrows.append(row)
            out.append("")
            out.append(title)
            out.append(format_table(["call"] + columns, mrows))

        metric_table("peak extra memory per call, MiB", "peak_extra_mib",
                     lambda x: "-" if x is None else f"{x:.1f}")
        metric_table("relative L2 error vs float64", "rel_l2_error", lambda x: fmt_sig(x, 2))
        if h200:
            metric_table("% of the H200 floor (fused 16-bit)", "h200_floor_pct",
                         lambda x: "-" if x is None else f"{x:.0f}%")
        if notes.items:
            out.append("")
            out.append(notes.render())
    ov = doc.get("overhead")
    if ov:
        out.append("")
        threads = f", kernels on {ov['threads']} thread" if ov.get("threads") else ""
        out.append("engine overhead: lib_attn.attention (current configuration) vs direct "
                   f"F.scaled_dot_product_attention, same inputs{threads}")
        for key in ("sd15_cross_mid", "sd15_cross_mid_sdpa", "tiny"):
            if key not in ov:
                continue
            m = ov[key]
            s = m["shape"]
            out.append(f"  ({s['b']},{s['heads']},{s['q_len']},{s['head_dim']})×{s['kv_len']} {m['dtype']}: "
                       f"direct {fmt_time(m['direct_us'])}, engine {fmt_time(m['engine_us'])} "
                       f"(ran {m['engine_backend']}{', pinned' if m.get('pinned') else ''}); added {m['added_us']:+.2f} µs median "
                       f"[p20 {m['added_p20_us']:+.2f}, p80 {m['added_p80_us']:+.2f}], "
                       f"{m['added_min_us']:+.2f} µs between fastest blocks; {m['rounds']} rounds")
            if not m["like_for_like"]:
                out.append("    (the engine ran another kernel than PyTorch's own choice, so this "
                           "difference includes the kernel)")
        if "dispatch" in ov:
            out.append(f"  dispatch alone (kernel call stubbed out, best of blocks): "
                       f"{ov['dispatch']['added_us']:.2f} µs per call")
    st = doc["settings"]
    others = st.get("other_processes_cpu_share")
    if others is not None and others > 0.1:
        out.append("")
        out.append(f"note: other processes used {others:.0%} of the {st['cpu_count']} CPUs during the run, "
                   "so times are inflated and spreads wide")
    out.append("")
    out.append(f"took {st['seconds']:.0f} s")
    out.append(f"memory: {doc['settings']['memory_method']}")
    out.append(f"error: {doc['settings']['reference']}")
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """Bar charts per model and dtype: attention ms per step, and the largest peak extra memory
    of one call, per backend column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: Dict[Tuple[str, int, str], List[dict]] = {}
    for s in doc["per_step"]:
        groups.setdefault((s["model"], s["res"], s["dtype"]), []).append(s)
    n_cols = len(doc["settings"]["columns"])
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, (1.0 + 0.42 * n_cols) * len(groups) + 0.4),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2]})
    for (ax_t, ax_m), ((model, res, dt), steps) in zip(axes, groups.items()):
        cells = [r for r in doc["results"] if (r["model"], r["res"], r["dtype"]) == (model, res, dt)]
        labels = [s["backend"] for s in steps]
        colors = ["#dd8452" if b == AUTO else "#4c72b0" for b in labels]
        unit = "decode" if model == "vae" else "step"
        times = [s["ms"] or 0.0 for s in steps]
        kinds = len(cells) // len(steps)  # call kinds in this model
        texts = [f"{s['ms']:.1f}" if s["ms"] is not None else
                 f"n/a ({len(s['missing'])} of {kinds} call kinds not run)" for s in steps]
        peaks = []
        for b in labels:
            values = [r["peak_extra_mib"] for r in cells if r["backend"] == b and r["peak_extra_mib"] is not None]
            peaks.append(max(values) if values else None)
        _bars(ax_t, labels, times, texts, colors)
        ax_t.set_xlabel(f"attention ms per {unit} (lower is better)")
        ax_t.set_title(f"{shapes.MODEL_LABELS[model]} @ {res}, {dt}: {doc['device']['description']}",
                       fontsize=9, loc="left")
        _bars(ax_m, labels, [p or 0.0 for p in peaks],
              [f"{p:.1f}" if p is not None else "-" for p in peaks], colors)
        ax_m.set_yticklabels([])
        ax_m.set_xlabel("largest peak extra memory of one call, MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels: List[str], values: List[float], texts: List[str], colors: List[str]) -> None:
    bars = ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    top = max(values) if any(values) else 1.0
    for bar, text in zip(bars, texts):
        ax.text(bar.get_width() + top * 0.01, bar.get_y() + bar.get_height() / 2, text,
                va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)


def matplotlib_missing() -> Optional[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed in this Python "
                f"({sys.executable}); install it with: {sys.executable} -m pip install matplotlib")
    return None
