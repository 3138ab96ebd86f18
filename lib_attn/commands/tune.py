"""``python -m lib_attn tune``: rank the backends on every attention call kind of a model, store the
rankings (so that the webui starts with them), and print each candidate's time, the winner and its
speed-up over the fixed order. The inputs are random, laid out as A1111 passes them.

The command only drives the engine's tuning (``lib_attn.tune``: measuring, ranking, the stored file)
with tuning on, one call per call kind."""
from __future__ import annotations

import time
from typing import List, Optional

import torch

import lib_attn
from lib_attn import shapes, tuning_file
from lib_attn import tune as _tune
from lib_attn.chains import chain_for
from lib_attn.decision import decide
from lib_attn.spec import spec_of

from .bench import Timer, make_inputs
from .dtypes import default_dtype, dtype_name
from .environment import environment
from .formats import fmt_time, format_table


def tune_call(call: shapes.AttentionCall, dtype: torch.dtype, device: torch.device) -> dict:
    """Tune one call kind (tuning must be on) and describe the result."""
    q, k, v = make_inputs(call, dtype, device)
    timer = Timer(device)

    def once() -> float:
        timer.sync()
        t0 = time.perf_counter()
        lib_attn.attention(q, k, v, role=call.role)
        timer.sync()
        return time.perf_counter() - t0

    first, again = once(), once()
    d = lib_attn.explain(q, k, v, role=call.role)
    cfg = lib_attn.config()
    spec = spec_of(q, k, v, None, "bhsd", call.role)
    chain, explicit = chain_for(call.role, spec.device, None, cfg, spec)
    order = decide(spec, chain, fp32=cfg.fp32, explicit=explicit).backend
    stored = tuning_file.lookup(spec, cfg.fp32) or {}
    timings = dict(d.timings)
    speedup = timings[order] / timings[d.backend] if order in timings and d.backend in timings else None
    return {
        "model": call.model, "res": call.res, "where": call.where, "role": call.role,
        "shape": list(call.shape), "calls": call.calls, "dtype": dtype_name(dtype),
        "backend": d.backend, "source": d.source, "order": order, "timings": timings,
        "rejected": dict(stored.get("rejected", {})), "speedup": speedup,
        # The first call ranks the candidates and then runs the winner, which the second call repeats.
        "tuning_ms": (first - again) * 1e3 if d.source == "measured" else None,
    }


def run(models: List[str], res: Optional[int], dtypes: Optional[List[torch.dtype]], device: torch.device) -> List[dict]:
    """Tune every call kind of ``models`` in each of ``dtypes`` (None: the device's default per role)."""
    rows = []
    lib_attn.reset()  # each call kind decided afresh: measured now, or read from the tuning file
    with lib_attn.use(tune="on"):
        for model in models:
            for call in shapes.model_calls(model, res):
                for dtype in dtypes or [default_dtype(call.role, gpu=device.type == "cuda")]:
                    rows.append(tune_call(call, dtype, device))
    return rows


def render(rows: List[dict], device: torch.device) -> str:
    """The text report: per model and dtype, a table of each candidate's time per call."""
    out = [f"lib_attn tune: {environment(device)['device']['description']}; results in {tuning_file.cache_path()}"]
    if not _tune.enabled(lib_attn.config().tune, device.type):
        out.append(f"note: tuning is {lib_attn.config().tune} on {device.type} in use, so later runs use these "
                   "rankings only with tuning on (--attn-tune on, the Tune setting, or lib_attn.configure(tune=\"on\"))")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["res"], r["dtype"]), []).append(r)
    for (model, res, dt), group in groups.items():
        ids = list(dict.fromkeys(b for r in group for b in list(r["timings"]) + list(r["rejected"])))
        out += ["", f"{shapes.MODEL_LABELS[model]} @ {res}, {dt}: median per call of each candidate"]
        table = []
        for r in group:
            cells = [fmt_time(r["timings"][b] * 1e6) if b in r["timings"] else
                     ("rejected" if b in r["rejected"] else "-") for b in ids]
            table.append([r["where"], ",".join(map(str, r["shape"])), *cells, r["backend"], r["order"],
                          f"{r['speedup']:.2f}×" if r["speedup"] else "-",
                          f"{r['tuning_ms']:.0f} ms" if r["tuning_ms"] is not None else r["source"]])
        out.append(format_table(["call", "b,h,q,kv,d", *ids, "winner", "fixed order", "speed-up",
                                 "tuning"], table, right_from=2))
        for r in group:
            for b, why in r["rejected"].items():
                out.append(f"  {r['where']}: {b} rejected: {why}")
        spent = [r["tuning_ms"] for r in group if r["tuning_ms"] is not None]
        if spent:
            out.append(f"tuning cost: {sum(spent):.0f} ms for {len(spent)} call kinds "
                       f"({sum(spent) / len(spent):.0f} ms per call kind on average, once per machine)")
    return "\n".join(out)
