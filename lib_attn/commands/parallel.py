"""``python -m lib_attn parallel``: start N ranks on this machine (NCCL on GPUs, gloo on CPU), run a
model's attention calls split over them in every mode their number allows, check each rank's share
against the one-process call, and time them, with the bytes each rank sent beside the kernel time.

The launcher (``run``) starts the ranks as ``python -m lib_attn parallel --as-rank ...`` with
torchrun's environment (``lib_attn.parallel.launch``); each rank (``rank_main``) reports its rows,
and the launcher joins them: a mode passes when every rank's share is within the engine's bound for
the dtype (``lib_attn.check.bound``) of a float64 reference of the whole call.
"""
from __future__ import annotations

import statistics
import time

import torch

from lib_attn import shapes
from lib_attn.check import bound
from lib_attn.parallel import launch, plan

from .dtypes import dtype_name, parse_dtype

DEFAULT_MODELS = ("flux", "wan")


def grids(world: int) -> list[tuple[int, int]]:
    """Every (ulysses, ring) of ``world`` ranks."""
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0]


def scaled(call, factor: int):
    """``call`` with its split tokens and its heads divided by ``factor`` (text tokens kept): within a
    CPU's reach, at the same head size."""
    if factor == 1:
        return call
    spec = shapes.SPECS[call.model]
    text = getattr(spec, "text_tokens", 0) if call.kind == "self" and getattr(spec, "joint", True) else 0
    n = max(1, (call.q_len - text) // factor)
    heads = max(1, call.heads // factor)
    kv = n + text if call.kind == "self" else call.kv_len
    return shapes.AttentionCall(call.model, call.res, call.where, call.kind, call.role, call.b, heads, n + text, kv,
                                call.head_dim, call.calls)


def run(ranks: int, argv: list, timeout: float) -> dict:
    """Launch the ranks and join their reports into one document."""
    started = time.monotonic()
    results = launch.run_ranks(ranks, ["-m", "lib_attn", "parallel", "--as-rank", *argv], timeout=timeout)
    doc = {"ranks": ranks, "rows": [], "failed_ranks": [], "seconds": round(time.monotonic() - started, 1)}
    reports = []
    for r in results:
        if r["returncode"] != 0 or not r["result"]:
            doc["failed_ranks"].append({"rank": r["rank"], "returncode": r["returncode"], "output": r["output"][-2000:]})
        else:
            reports.append(r["result"])
    if reports and not doc["failed_ranks"]:
        doc.update({k: reports[0][k] for k in ("backend", "device", "dtype", "scale", "torch")})
        for i, row in enumerate(reports[0]["rows"]):
            mine = [rep["rows"][i] for rep in reports]
            doc["rows"].append({**row, "err": max(m["err"] for m in mine), "ok": all(m["ok"] for m in mine),
                                "ms_parallel": max(m["ms_parallel"] for m in mine),
                                "bytes_per_call": max(m["bytes_per_call"] for m in mine)})
    doc["ok"] = bool(doc["rows"]) and not doc["failed_ranks"] and all(row["ok"] for row in doc["rows"])
    return doc


def render(doc: dict) -> str:
    lines = []
    if doc["failed_ranks"]:
        for f in doc["failed_ranks"]:
            lines.append(f"rank {f['rank']} failed (exit {f['returncode']}):\n{f['output']}")
        return "\n".join(lines)
    lines.append(f"{doc['ranks']} ranks on {doc['device']} ({doc['backend']}), {doc['dtype']}, torch {doc['torch']}"
                 + (f"; calls scaled down {doc['scale']}x (tokens and heads)" if doc["scale"] > 1 else ""))
    lines.append(f"{'call':<24} {'mode':<13} {'UxR':>5} {'shape (b,h,n,d)':>22} {'error':>9} {'bound':>7} "
                 f"{'1 process':>10} {'parallel':>10} {'sent/rank':>11} {'formula':>11}")
    for row in doc["rows"]:
        lines.append(f"{row['model'] + ' ' + row['where']:<24} {row['mode']:<13} {row['grid']:>5} "
                     f"{str(tuple(row['shape'])):>22} {row['err']:>9.2e} {row['bound']:>7.0e} "
                     f"{row['ms_one_process']:>8.2f}ms {row['ms_parallel']:>8.2f}ms "
                     f"{_mib(row['bytes_per_call']):>11} {_mib(row['bytes_formula']):>11}"
                     + ("" if row["ok"] else "  FAILED") + "".join(f"  ({note})" for note in row.get("notes", ())))
    lines.append("all modes match the one-process call" if doc["ok"] else "SOME MODES FAILED")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# ------------------------------------------------------------------ one rank

def rank_main(models, res, dtype_text, scale, repeat: int, timeout: float) -> None:
    import lib_attn
    from lib_attn import parallel

    rank, world, backend = launch.init(timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    dtype = parse_dtype(dtype_text) if dtype_text else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    scale = scale if scale is not None else (1 if device.type == "cuda" else 8)
    rows = []
    configs = {g: parallel.Parallel(ulysses=g[0], ring=g[1], timeout=timeout) for g in grids(world)}
    for model in models:
        spec = shapes.SPECS[model]
        for call in shapes.model_calls(model, res):
            call = scaled(call, scale)
            joint = call.kind == "self" and getattr(spec, "joint", True) and getattr(spec, "text_tokens", 0)
            text = spec.text_tokens if joint else 0
            kind = "cross" if call.kind == "cross" else ("joint" if text else "self")
            n = call.q_len - text
            gen = torch.Generator(device=device).manual_seed(1234)
            shape = (call.b, call.heads)
            q_full = torch.randn(*shape, call.q_len, call.head_dim, generator=gen, device=device, dtype=dtype)
            k_full = torch.randn(*shape, call.kv_len, call.head_dim, generator=gen, device=device, dtype=dtype)
            v_full = torch.randn(*shape, call.kv_len, call.head_dim, generator=gen, device=device, dtype=dtype)
            ref = lib_attn.attention(q_full.double(), k_full.double(), v_full.double(), role=call.role, backend="math")
            one_ms = _time(lambda: lib_attn.attention(q_full, k_full, v_full, role=call.role), repeat, device)
            start, stop = parallel.bounds(n, world, rank)
            sl = slice(text + start, text + stop)
            q = torch.cat([q_full[:, :, :text], q_full[:, :, sl]], dim=2)
            want = torch.cat([ref[:, :, :text], ref[:, :, sl]], dim=2)
            k, v = (k_full, v_full) if kind == "cross" else (torch.cat([x[:, :, :text], x[:, :, sl]], dim=2)
                                                               for x in (k_full, v_full))
            for (u, r), par in configs.items():
                def call_once():
                    return parallel.attention(q, k, v, kind=kind, text_len=text, seq_len=n, role=call.role,
                                              parallel=par)
                with lib_attn.recording() as rec:
                    out = call_once()
                err = float(torch.linalg.vector_norm(out.double() - want) / torch.linalg.vector_norm(want))
                ms = _time(call_once, repeat, device)
                sent = sum(b for _, b in rec.parallel.values())
                formula = plan.call_bytes(call.b, call.heads, n, call.head_dim, q.element_size(), world, u, r,
                                          text, kind)["total"]
                rows.append({"model": model, "where": call.where, "kind": kind, "mode": par.mode if kind != "cross"
                             else "local", "grid": f"{u}x{r}", "shape": [call.b, call.heads, call.q_len, call.head_dim],
                             "err": err, "bound": bound(dtype, device.type, False),
                             "ok": err <= bound(dtype, device.type, False), "ms_one_process": one_ms,
                             "ms_parallel": ms, "bytes_per_call": sent, "bytes_formula": formula,
                             "notes": sorted({key[-1] for key in rec.parallel if key[-1]})})
    launch.report({"rows": rows, "backend": backend, "device": str(device) if device.type == "cpu"
                   else torch.cuda.get_device_name(device), "dtype": dtype_name(dtype), "scale": scale,
                   "torch": torch.__version__})
    launch.finish()


def _time(fn, repeat: int, device) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs after one warm-up (synchronised on a GPU)."""
    fn()
    times = []
    for _ in range(max(1, repeat)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)
