"""The engine's own cost per attention call, which the bench reports under its tables.

``engine_overhead`` measures ``lib_attn.attention`` against a direct ``F.scaled_dot_product_attention``
on the same inputs (SD1.5's smallest cross-attention and a tiny call), and ``dispatch_cost`` the
dispatch alone, with the kernel call replaced by a no-op: the "+X µs median" and "dispatch alone" lines.
Both run again with a schedule in force (``SCHEDULE``, or the bench's ``--schedule``) and the sampling
position inside its middle window (``AT_STEP``), as a host sets it: the "with a schedule" line.
"""
from __future__ import annotations

import gc
import time
from typing import Dict, List, Optional

import torch

import lib_attn
from lib_attn import _compat
from lib_attn import schedule as _schedule

from ..dtypes import dtype_name
from .timing import Timer, quantile, summarize

OVERHEAD_SHAPE = (2, 8, 64, 77, 160)  # b, h, q, kv, d: SD1.5's smallest cross-attention
TINY_SHAPE = (1, 1, 16, 16, 64)
#: A schedule as users write them (three step windows), each naming PyTorch's own choice, so the
#: timing compares the same kernel with and without it; the position is step 10 of 20 (its middle rule).
SCHEDULE = "0-20%: sdpa; 20-80%: sdpa; 80-100%: sdpa"
AT_STEP = (10, 20)


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
        return _compat.TORCH_SDPA(q, k, v)

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
    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    lib_attn.attention(q, q, q)
    decision = lib_attn.explain(q, q, q)  # after a call: the cached decision itself
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


def engine_overhead(device: torch.device, dtype: torch.dtype, rounds: int = 200, schedule=SCHEDULE) -> dict:
    """The engine's added time per call at SD1.5's smallest cross-attention (the budget's
    shape) and at a tiny call, where the kernel's own noise hides less of it; then the tiny call
    and the dispatch alone again with ``schedule`` in force (None: not measured)."""
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
            "guard": lib_attn.config().guard,
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
        if schedule is not None:
            result["schedule"] = scheduled_overhead(device, dtype, rounds, schedule)
    finally:
        torch.set_num_threads(threads)
    return result


def scheduled_overhead(device: torch.device, dtype: torch.dtype, rounds: int, schedule) -> dict:
    """The tiny call's added time and the dispatch alone with ``schedule`` in force and the sampling
    position at ``AT_STEP``; the configuration and the position are as before afterwards."""
    step, total = AT_STEP
    with lib_attn.use(schedule=schedule) as cfg:
        _schedule.at_step(step, total)
        try:
            return {"text": cfg.schedule.text if cfg.schedule is not None else "", "at_step": step, "steps": total,
                    "tiny": measure_overhead(device, dtype, TINY_SHAPE, rounds=rounds, inner=20),
                    "dispatch": dispatch_cost(device, dtype)}
        finally:
            _schedule.leave()
