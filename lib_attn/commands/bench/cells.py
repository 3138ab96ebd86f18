"""The bench's results: one ``Cell`` per call, dtype and backend column (its numbers, or why it has
none), finished from its timing samples, and the call-weighted sums per denoising step."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from lib_attn import shapes

from .timing import quantile, summarize

AUTO = "auto"  # the column that runs the engine's own choice; the others pin one backend each


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
    peak_extra_mib: Optional[float] = None  # a steady call of the signature
    first_call_extra_mib: Optional[float] = None  # its first call: the guard's first check, auto's tuning
    rel_l2_error: Optional[float] = None
    max_abs_error: Optional[float] = None
    h200_floor_pct: Optional[float] = None
    memory_error: str = ""
    _times: List[float] = field(default_factory=list, repr=False)
    _walls: List[float] = field(default_factory=list, repr=False)

    def public(self) -> dict:
        """The cell as the result document has it: every field but the raw samples."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def first_line(exc: BaseException) -> str:
    """An exception as a cell's reason: its type and first line, at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_h200(env: dict) -> bool:
    """Whether the environment's device is an H200, whose floor the report compares against."""
    return "H200" in (env.get("device") or {}).get("name", "")


def finish_cell(cell: Cell, call: shapes.AttentionCall, env: dict) -> None:
    """Turn a cell's timing samples into its median, spread, TFLOP/s and H200 share."""
    if cell.status != "ok" or not cell._times:
        cell._times = []
        return
    stats = summarize(cell._times)
    cell.median_us, cell.p20_us, cell.p80_us = stats["median_us"], stats["p20_us"], stats["p80_us"]
    cell.samples = stats["samples"]
    cell.wall_us = quantile(sorted(cell._walls), 0.5) * 1e6
    cell.tflops = call.flops / (cell.median_us * 1e-6) / 1e12
    if is_h200(env) and cell.dtype in ("float16", "bfloat16"):
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
