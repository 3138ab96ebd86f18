"""The bench's run: its settings, the backend columns, and for every call row the cells' preparation
(decide, warm up, check against float64), rounds planned to the time budget and timed interleaved,
then memory, engine overhead and the result document (``SCHEMA``).

Rounds alternate over a row's backends, the order rotating every round so that clock and thermal
drift fall on all of them alike; with ``tune`` on, the auto column's tuning measures on the call
kind's first call, outside every sample.
"""
from __future__ import annotations

import gc
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

import lib_attn
from lib_attn import shapes, tuning_file

from ..dtypes import default_dtype, dtype_name, parse_dtype
from ..environment import environment
from .cells import AUTO, Cell, finish_cell, first_line, is_h200, per_step
from .inputs import ERROR_ROWS, make_inputs, output_error, reference_rows, sample_rows
from .memory import (CPU_MEMORY_METHOD, CUDA_MEMORY_METHOD, MIB, cpu_peak_supported, cuda_peak,
                     measure_cpu_memory)
from .overhead import SCHEDULE, engine_overhead
from .progress import Progress
from .timing import OtherLoad, Timer, load_average

SCHEMA = "lib_attn.bench/1"
#: On the CPU a video call runs at 1/8 of its video tokens and heads: Wan 2.2's 720p self-attention
#: (117 TFLOP on 40 heads of 75,600 tokens) becomes 229 GFLOP, seconds instead of minutes.
CPU_VIDEO_SCALE = 8
GPU_WARMUP_S = 0.025
# On the CPU a call this slow counts its first (verification) run as one of its samples: one-time
# costs are a small part of it, and a median over three or more samples ignores one slow run.
FIRST_RUN_SAMPLE_S = 0.25


@dataclass
class BenchSettings:
    """What to run: the command line's options (``None`` means the device's default)."""

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
    schedule: Optional[str] = SCHEDULE  # in force for the overhead's second measurement; None: not measured
    memory: bool = True
    progress: bool = True
    seed: int = 0
    tune: str = "on"  # the auto column's tuning mode
    video_scale: Optional[int] = None  # video calls' tokens and heads divided by it (None: 8 on CPU, 1 on GPU)


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
    return [dtype_name(default_dtype(call.role, gpu=device.type == "cuda"))]


def _reasons_for(decision, backend: str) -> List[str]:
    """The engine's reasons for passing ``backend`` over in ``decision``."""
    for bid, reasons in getattr(decision, "rejected", []) or []:
        if bid == backend:
            return list(reasons)
    return []


def _kernel_text(rec, bid: str) -> str:
    """The recording's description of the kernel ``bid`` ran."""
    kernels = getattr(rec, "kernels", None) or {}
    return str(kernels.get(bid, "")) if bid else ""


def _ran(rec, role: str) -> Tuple[str, str]:
    """(backend id(s) that ran, fallback reasons) from a recording."""
    ran = sorted({bid for (r, bid), n in rec.calls.items() if r == role and n})
    falls = sorted({f"{bid}: {reason}" for (r, bid, reason), n in rec.fallbacks.items()
                    if r == role and n})
    return ",".join(ran), "; ".join(falls)


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

    def first_call():  # the signature's first call: the guard's first check, and auto's tuning
        if not timer.cuda:
            return fn()  # measured in a subprocess (``measure_cpu_memory``)
        out, cell.first_call_extra_mib = cuda_peak(fn, timer.device)
        return out

    try:
        if pinned is None:
            first_call()  # tuning measures here, outside every sample
            decision = lib_attn.explain(q, k, v, role=call.role)
            cell.tuned = decision.source
            cell.timings_us = {b: t * 1e6 for b, t in decision.timings.items()} or None
        with lib_attn.recording() as rec:
            t0 = time.perf_counter()
            out = fn() if pinned is None else first_call()
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
        out, cell.peak_extra_mib = cuda_peak(fn, timer.device)
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
        cell.status, cell.reason = "failed", first_line(exc)
        return None, 0.0


def _plan_rounds(estimates: List[float], budget: float, settings: BenchSettings) -> Tuple[int, int]:
    """(rounds, calls per round) so that a row's timed work is about ``budget`` seconds."""
    total = max(sum(estimates), 1e-6)
    samples = int(min(settings.max_samples, max(settings.min_rounds, budget / total)))
    rounds = max(settings.min_rounds, min(samples, 10))
    return rounds, max(1, math.ceil(samples / rounds))


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
                        cell.status, cell.reason = "failed", first_line(exc)
                progress.step(f"{call.model} {call.where} {cell.backend} round {r + 1}/{rounds}")
    finally:
        if gc_was:
            gc.enable()


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
    video_scale = settings.video_scale or (CPU_VIDEO_SCALE if device.type == "cpu" else 1)

    rows_calls = []  # (call, dtype name)
    for model in settings.models:
        for call in shapes.model_calls(model, settings.res):
            call = shapes.scaled_down(call, video_scale)
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
    load_start = load_average()
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
            finish_cell(cell, call, env)
        cells.extend(row_cells)
        del q, k, v, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()

    memory_method = None
    if settings.memory:
        if device.type == "cuda":
            memory_method = CUDA_MEMORY_METHOD  # measured as each cell was prepared
        elif cpu_memory:
            memory_method = CPU_MEMORY_METHOD
            progress.starting("peak memory: one fresh process per cell")
            _cpu_memory(cells, rows_calls, progress, n_cells)
        else:
            memory_method = "unavailable: needs Linux /proc/self/clear_refs"

    overhead = None
    if settings.overhead:
        ov_dtype = torch.float32 if device.type == "cpu" else torch.float16
        progress.starting("engine overhead: measuring")
        overhead = engine_overhead(device, ov_dtype, settings.overhead_rounds, settings.schedule)
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
            "tune": settings.tune, "tuning_file": tuning_file.cache_path(),
            "video_scale": video_scale if any(m in shapes.VIDEO_MODELS for m in settings.models) else None,
            "first_run_is_a_sample_above_s": None if timer.cuda else FIRST_RUN_SAMPLE_S,
            "reference": f"float64 softmax(QKᵀ/√d)V on up to {ERROR_ROWS} evenly spaced query rows",
            "inputs": "A1111 layout: (b, s, h·d) viewed (b, s, h, d) and transposed to (b, h, s, d)",
            "h200_floor": is_h200(env),
            "seconds": round(time.monotonic() - t_start, 2),
            "cpu_count": os.cpu_count(),
            "load_average": {"start": load_start, "end": load_average()},
            "other_processes_cpu_share": other_load.share(),
        },
        "backends": env["backends"],
        "calls": [dict(asdict(call), gflop=call.flops / 1e9, dtype=dt) for call, dt in rows_calls],
        "results": [c.public() for c in cells],
        "per_step": per_step(rows_calls, cells, columns),
        "overhead": overhead,
    }


def _cpu_memory(cells: List[Cell], rows_calls, progress: Progress, n_cells: int) -> None:
    """The peak extra memory of each cell that ran, measured one call at a time in a fresh
    subprocess (``measure_cpu_memory``)."""
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
            c.first_call_extra_mib = res["first_call_extra_bytes"] / MIB
        else:
            c.memory_error = res.get("error", "")
