"""``python -m lib_attn bench --sparse``: dense against sparse attention on a model's long self-attention
calls (video calls at 1/N of their tokens and heads on a CPU, ``--video-scale``), or on one call given
as ``--sparse-call BxNxHxD``.

For each call, on two kinds of input (``inputs.local_inputs``: q and k share a smooth function of each
token's place on the video's (frames, height, width) grid, so attention is local as in a video model;
and plain random q, k, v, whose attention is diffuse):

* **dense**: ``F.scaled_dot_product_attention``; **kernel**: the ``block-sparse`` backend at the fixed
  ``--sparse-topk`` (and, where FlexAttention runs, its gather design too), with the share of key
  blocks it computed; **engine**: ``lib_attn.attention`` with sparse on (``--sparse-settings``), which
  calibrates per call kind within the budget: its steady time, its setting and the error it reported;
* times: medians of interleaved rounds (each round runs every column once, in rotating order); the
  first call of each column apart (FlexAttention's compile, calibration);
* error: relative L2 against float64 on evenly spaced query rows;
* extra memory on the CPU: the resident-set high-water mark over the resident set before the call,
  first call and a steady call;
* error against the share of key blocks kept (``share_errors``): the routing at each top-k of the
  calibration ladder, its share of (query block, key block) pairs, and the error against float64 of
  attention over the routed blocks alone and with every other block through its pooled term (what
  ``block-sparse`` runs, in both its designs), on local, RoPE-like and diffuse inputs.

Progress goes to stderr at each step and, while a step runs, every ``HEARTBEAT_S`` seconds.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import replace
from typing import List, Optional, Tuple

import torch

import lib_attn
from lib_attn import _compat, shapes
from lib_attn.kernels import REGISTRY
from lib_attn.check import Samples
from lib_attn.kernels.block_sparse import flex
from lib_attn.kernels.sparse import TOPK_LADDER
from lib_attn import sparse_measure
from lib_attn import sparse_plan

from ..formats import fmt_time, format_table
from .inputs import local_inputs, output_error, reference_rows, rope_inputs, sample_rows
from .memory import MIB, _reset_rss_peak, _status_kib, cpu_peak_supported
from .timing import load_average

DEFAULT_SETTINGS = "block-sparse, min_tokens=1, dense=none"
#: Seconds between two progress lines while one step runs.
HEARTBEAT_S = 10.0
#: The inputs the error-against-share table uses, with their generator and strength.
SHARE_INPUTS = (("local", local_inputs, 0.7), ("rope", rope_inputs, 0.5), ("diffuse", local_inputs, 0.0))


class Progress:
    """Progress lines on stderr: ``bench --sparse: <step> (12 s)`` at each step, and again every
    ``HEARTBEAT_S`` seconds while a step runs (a dense call at 16,384 tokens takes tens of seconds on a CPU)."""

    def __init__(self, stream=None, every: float = HEARTBEAT_S):
        self.stream = stream or sys.stderr
        self.every = every
        self.t0 = time.monotonic()
        self.label = "starting"
        self._stop = threading.Event()
        self._thread = None

    def step(self, label: str) -> None:
        self.label = label
        self._write()

    def _write(self) -> None:
        self.stream.write(f"bench --sparse: {self.label} ({time.monotonic() - self.t0:.0f} s)\n")
        self.stream.flush()

    def __enter__(self):
        def beat():
            while not self._stop.wait(self.every):
                self._write()
        self._thread = threading.Thread(target=beat, name="bench-sparse-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def share_errors(b: int, heads: int, head_dim: int, grid, dtype, device, rows: torch.Tensor, progress=None) -> dict:
    """{inputs: [{"topk", "kept", "routed", "pooled"}]}: per top-k of the ladder, the share of blocks the
    routing keeps and the error against float64, on ``rows``, of attention over the routed blocks alone
    and with the pooled term for the rest."""
    backend = REGISTRY["block-sparse"]
    knobs = [lib_attn.Knob("topk", t) for t in TOPK_LADDER]
    out = {}
    for name, make, strength in SHARE_INPUTS:
        if progress is not None:
            progress.step(f"error against share of blocks kept, {name} inputs")
        q, k, v = make(b, heads, grid, head_dim, dtype, device, seed=1, strength=strength)
        pooled = backend.routings(q, k, None, knobs)
        plain = [replace(r, pooled=False) for r in pooled]
        pairs = torch.arange(b * heads)
        samples = Samples(pairs // heads, pairs % heads, rows)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        routed = sparse_measure.routed_errors(q64, k64, v64, None, "bhsd", plain, samples)
        with_pooled = sparse_measure.routed_errors(q64, k64, v64, None, "bhsd", pooled, samples)
        out[name] = [{"topk": kn.value, "kept": float(r.kept), "routed": e0, "pooled": e1}
                     for kn, r, e0, e1 in zip(knobs, pooled, routed, with_pooled)]
    return out


def video_grid(call: shapes.AttentionCall, factor: int) -> Tuple[int, ...]:
    """The (frames, height, width) latent grid of a video call, its height and width divided by
    sqrt(``factor``) (frames kept), so that it holds about 1/``factor`` of the tokens."""
    spec = shapes.SPECS[call.model]
    step = 8 * spec.patch
    width = shapes.VIDEO_SIZES.get(call.res, round(call.res * 16 / 9 / step) * step)
    frames = (spec.frames - 1) // spec.time_stride + 1
    shrink = math.sqrt(factor)
    return frames, max(1, round(call.res // step / shrink)), max(1, round(width // step / shrink))


def calls_for(models: List[str], res, factor: int) -> List[Tuple[str, int, int, int, Tuple[int, ...]]]:
    """(label, batch, heads, head_dim, grid) of each model's self-attention call."""
    out = []
    for model in models:
        for call in shapes.model_calls(model, res):
            if call.kind != "self" or not isinstance(shapes.SPECS[model], shapes.VideoSpec):
                continue
            grid = video_grid(call, factor)
            heads = max(1, call.heads // factor)
            label = f"{model} {call.where}" + (f" ÷{factor}" if factor > 1 else "")
            out.append((label, call.b, heads, call.head_dim, grid))
    return out


def _peak_extra(fn) -> Tuple[object, Optional[float]]:
    """(fn's result, MiB of resident set above the one before the call) on Linux, else None."""
    if not cpu_peak_supported():
        return fn(), None
    before = _status_kib("VmRSS")
    _reset_rss_peak()
    result = fn()
    return result, (_status_kib("VmHWM") - before) / 1024


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def measure(label: str, b: int, heads: int, head_dim: int, grid, dtype, device, rounds: int, topk: float,
            settings: str, progress=None) -> dict:
    def step(text):
        if progress is not None:
            progress.step(f"{label}: {text}")

    n = math.prod(grid)
    rows = sample_rows(n)
    backend = REGISTRY["block-sparse"]
    knob = lib_attn.Knob("topk", topk)
    out = {"call": label, "shape": [b, n, heads, head_dim], "grid": list(grid), "inputs": {}}
    for kind in ("local", "diffuse"):
        sparse_plan.forget()  # each kind of input calibrated on its own, as a model's call kinds are
        q, k, v = local_inputs(b, heads, grid, head_dim, dtype, device, seed=1, strength=0.7 if kind == "local" else 0)
        ref = reference_rows(q, k, v, rows)
        columns = {"dense": lambda: _compat.TORCH_SDPA(q, k, v),
                   "kernel": lambda: backend.run_sparse(q, k, v, None, knob)}
        if backend.design(device.type, dtype, head_dim) == "flex":
            columns["gather"] = lambda: _gather(backend, q, k, v, knob)
        counted = lib_attn.Recording(here=True)  # every engine call of this input: first and timed ones

        def engine_call():
            with lib_attn.use(sparse=settings), lib_attn.recording(into=counted):
                return lib_attn.attention(q, k, v, role="dit")

        columns["engine"] = engine_call
        first, memory, times, results = {}, {}, {name: [] for name in columns}, {}
        for name, fn in columns.items():
            step(f"{kind} inputs, {name} first call" + (" (compile, calibration)" if name != "dense" else ""))
            start = time.perf_counter()
            results[name], memory[name] = _peak_extra(fn)
            first[name] = time.perf_counter() - start
        names = list(columns)
        steady_memory = {}
        for r in range(rounds):
            step(f"{kind} inputs, round {r + 1} of {rounds}")
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                start = time.perf_counter()
                if r == 0:
                    results[name], steady_memory[name] = _peak_extra(columns[name])
                else:
                    results[name] = columns[name]()
                times[name].append(time.perf_counter() - start)
        engine_out = results["engine"]
        counted.finish()
        gather_error = output_error(results["gather"].out, rows, ref)[0] if "gather" in results else None
        report = counted.sparse
        entry = {"median_s": {name: _median(t) for name, t in times.items()},
                 "first_s": first, "extra_mib_first": memory, "extra_mib_steady": steady_memory,
                 "error": {"dense": output_error(results["dense"], rows, ref)[0],
                           "kernel": output_error(results["kernel"].out, rows, ref)[0],
                           "engine": output_error(engine_out, rows, ref)[0]},
                 "kept": results["kernel"].share(),
                 "engine": {"sparse_calls": report.calls if report else 0,
                            "setting": [key[3] for key in report.kinds] if report else [],
                            "dense": [reason for (_, reason) in report.dense] if report else [],
                            "reported_error": report.error_max() if report else None}}
        if gather_error is not None:
            entry["error"]["gather"] = gather_error
        dense = entry["median_s"]["dense"]
        entry["speedup"] = {name: dense / t for name, t in entry["median_s"].items() if t}
        out["inputs"][kind] = entry
    out["design"] = backend.variant(_spec(q))
    out["share_errors"] = share_errors(b, heads, head_dim, grid, dtype, device, rows, progress)
    return out


def _spec(q):
    from lib_attn.spec import spec_of

    return spec_of(q, q, q, None, "bhsd", "dit")


def _gather(backend, q, k, v, knob):
    backend.forced = "gather"
    try:
        return backend.run_sparse(q, k, v, None, knob)
    finally:
        backend.forced = ""


def run(calls, dtype, device, rounds: int, topk: float, settings: str) -> dict:
    lib_attn.sparse.parse(settings)  # a bad line fails before anything runs
    load = load_average()
    with Progress() as progress:
        results = [measure(*call, dtype, device, rounds, topk, settings, progress) for call in calls]
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "rounds": rounds, "topk": topk, "settings": settings,
            "flex": flex.available(), "load_before": load, "load_after": load_average(), "results": results}


def render(doc: dict) -> str:
    lines = [f"Sparse attention: dense SDPA vs block-sparse ({doc['dtype']}, {doc['device']}, torch {doc['torch']}, "
             f"{doc['threads']} threads; medians of {doc['rounds']} interleaved rounds; kernel at topk "
             f"{doc['topk']:g}; engine: {doc['settings']})"]
    for res in doc["results"]:
        b, n, h, d = res["shape"]
        lines.append(f"\n{res['call']}: (b {b}, {n} tokens, {h} heads, {d}) on grid {'x'.join(map(str, res['grid']))}, "
                     f"kernel design {res['design']}")
        headers = ["inputs", "column", "median", "x dense", "first call", "error", "extra MiB first/steady"]
        rows = []
        for kind, e in res["inputs"].items():
            for name, t in e["median_s"].items():
                err = e["error"].get(name)
                first_mem, steady_mem = e["extra_mib_first"].get(name), e["extra_mib_steady"].get(name)
                mem = "/".join("?" if m is None else f"{m:.0f}" for m in (first_mem, steady_mem))
                rows.append([kind, name, fmt_time(t * 1e6), f"{e['speedup'].get(name, 0):.2f}",
                             fmt_time(e["first_s"][name] * 1e6), "" if err is None else f"{err:.3f}", mem])
            eng = e["engine"]
            ran = f"sparse {', '.join(eng['setting'])}" if eng["sparse_calls"] else "dense"
            why = f"; {'; '.join(eng['dense'])}" if eng["dense"] else ""
            said = "" if eng["reported_error"] is None else f"; reported error {eng['reported_error']:.3f}"
            rows.append([kind, "", f"kept {e['kept']:.1%}", "", "", f"engine: {ran}{why}{said}", ""])
        lines.append(format_table(headers, rows, right_from=2))
        shares = res.get("share_errors")
        if shares:
            lines.append("\nerror against float64 by share of key blocks kept (routed blocks alone / with the pooled "
                         "term for the rest, as block-sparse runs in both designs):")
            names = list(shares)
            table = []
            for i, entry in enumerate(shares[names[0]]):
                row = [f"topk {entry['topk']:g}"]
                for name in names:
                    e = shares[name][i]
                    row += [f"{e['kept']:.1%}", f"{e['routed']:.3f}", f"{e['pooled']:.3f}"]
                table.append(row)
            headers = ["setting"] + [f"{name} {col}" for name in names for col in ("kept", "routed", "pooled")]
            lines.append(format_table(headers, table, right_from=1))
    if doc.get("load_before"):
        lines.append(f"\nload average before/after: {doc['load_before'][0]:.1f} / {doc['load_after'][0]:.1f}")
    return "\n".join(lines)
