"""The bench's text report: per model and dtype, a table of time per call for every backend column
(with ms per step and TFLOP/s), tables of peak extra memory, error and (on an H200) % of the
floor, numbered footnotes for the cells that could not run, then the engine-overhead lines."""
from __future__ import annotations

from typing import Dict, List, Tuple

from lib_attn import shapes
from lib_attn.device import miopen_text

from ..formats import fmt_sig, fmt_time, format_table, shown
from .cells import AUTO


def fmt_spread(cell: dict) -> str:
    """A cell's median and half its p20-p80 spread as a share of it: ``1.23 ms ±4%``."""
    med = cell["median_us"]
    half = (cell["p80_us"] - cell["p20_us"]) / 2
    return f"{fmt_time(med)} ±{100 * half / med:.0f}%"


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
        out.append("auto: " + ("tuned: the engine measured each call kind's candidates, storing the ranking in "
                               f"{doc['settings'].get('tuning_file')} (or read it from there), and runs the "
                               "fastest correct one; 'auto ran' says measured or stored" if tuned == "on" else
                               f"tuning {tuned}: the engine's fixed order"))
    scale = doc["settings"].get("video_scale")
    if scale and scale > 1:
        out.append(f"video calls at 1/{scale} of their video tokens and heads (--video-scale {scale}), head size and "
                   "text kept: time, FLOPs and memory are those of the scaled call")
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

        def metric_table(title: str, fmt) -> None:
            mrows = []
            for c in calls:
                row = [c["where"]]
                for col in columns:
                    cell = index[(model, res, dt, c["where"], col)]
                    row.append(fmt(cell) if cell["status"] == "ok" else "-")
                mrows.append(row)
            out.append("")
            out.append(title)
            out.append(format_table(["call"] + columns, mrows))

        metric_table("peak extra memory per call, MiB: a steady call (the signature's first call)", _memory)
        metric_table("relative L2 error vs float64", lambda cell: fmt_sig(cell["rel_l2_error"], 2))
        if h200:
            metric_table("% of the H200 floor (fused 16-bit)",
                         lambda cell: "-" if cell["h200_floor_pct"] is None else f"{cell['h200_floor_pct']:.0f}%")
        if notes.items:
            out.append("")
            out.append(notes.render())
    ov = doc.get("overhead")
    if ov:
        out.append("")
        threads = f", kernels on {ov['threads']} thread" if ov.get("threads") else ""
        guard = f", guard {ov['guard']}" if ov.get("guard") else ""
        out.append(f"engine overhead: lib_attn.attention (current configuration{guard}) vs direct "
                   f"F.scaled_dot_product_attention, same inputs{threads}")
        for key in ("sd15_cross_mid", "sd15_cross_mid_sdpa", "tiny"):
            if key in ov:
                out.extend(_overhead_row(ov[key]))
        if "dispatch" in ov:
            out.append(f"  dispatch alone (kernel call stubbed out, best of blocks): "
                       f"{ov['dispatch']['added_us']:.2f} µs per call")
        sched = ov.get("schedule")
        if sched:
            out.append(f"  with a schedule in force ({sched['text'] or 'none'}), at step {sched['at_step']} of "
                       f"{sched['steps']}:")
            out.extend("  " + line for line in _overhead_row(sched["tiny"]))
            out.append(f"    dispatch alone: {sched['dispatch']['added_us']:.2f} µs per call")
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


def _memory(cell: dict) -> str:
    """``1.2 (2.0)``: a steady call's peak extra MiB, and its first call's."""
    steady, first = cell["peak_extra_mib"], cell.get("first_call_extra_mib")
    if steady is None:
        return "-"
    return f"{steady:.1f}" + ("" if first is None else f" ({first:.1f})")


def _overhead_row(m: dict) -> list:
    """One call's overhead line (and the note when the engine ran another kernel)."""
    s = m["shape"]
    lines = [f"  ({s['b']},{s['heads']},{s['q_len']},{s['head_dim']})×{s['kv_len']} {m['dtype']}: "
             f"direct {fmt_time(m['direct_us'])}, engine {fmt_time(m['engine_us'])} "
             f"(ran {m['engine_backend']}{', pinned' if m.get('pinned') else ''}); added {m['added_us']:+.2f} µs median "
             f"[p20 {m['added_p20_us']:+.2f}, p80 {m['added_p80_us']:+.2f}], "
             f"{m['added_min_us']:+.2f} µs between fastest blocks; {m['rounds']} rounds"]
    if not m["like_for_like"]:
        lines.append("    (the engine ran another kernel than PyTorch's own choice, so this "
                     "difference includes the kernel)")
    return lines
