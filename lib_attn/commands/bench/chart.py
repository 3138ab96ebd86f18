"""The bench's charts (``--plot FILE.png``, needs matplotlib): per model and dtype, bars of attention
ms per step and of the largest peak extra memory of one call, per backend column; with ``--sparse``, per
call, the error against float64 by share of key blocks kept, for the routed blocks alone and with the
pooled term for the rest, on each kind of input."""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Tuple

from lib_attn import shapes

from .cells import AUTO


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


#: The two designs of the error-against-share chart: (the share table's key, label, line style).
SPARSE_DESIGNS = (("routed", "routed blocks alone", "--"), ("pooled", "with the pooled term (block-sparse)", "-"))


def plot_sparse(doc: dict, path: str) -> list:
    """``bench --sparse``'s chart: per call, the error against float64 (log scale) by share of key blocks
    kept, one line per kind of input and design, the engine's budget dotted. Returns the series drawn
    (``inputs: design`` labels), which the PNG also holds in its ``Series`` text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lib_attn import sparse

    calls = [r for r in doc["results"] if r.get("share_errors")]
    fig, axes = plt.subplots(1, max(1, len(calls)), figsize=(6.5 * max(1, len(calls)), 4.6), squeeze=False)
    budget = sparse.parse(doc["settings"]).budget
    series = []
    for ax, res in zip(axes[0], calls):
        for i, (inputs, entries) in enumerate(res["share_errors"].items()):
            kept = [100 * e["kept"] for e in entries]
            for key, label, style in SPARSE_DESIGNS:
                name = f"{inputs}: {label}"
                ax.plot(kept, [e[key] for e in entries], style, marker="o", markersize=3, color=f"C{i}", label=name)
                series.append(name)
        ax.axhline(budget, color="0.4", linestyle=":", linewidth=1, label=f"budget {budget:g}")
        ax.set_yscale("log")
        ax.set_xlabel("share of key blocks kept, %")
        ax.set_ylabel("relative L2 error against float64")
        b, n, h, d = res["shape"]
        ax.set_title(f"{res['call']}: {n} tokens on {'x'.join(map(str, res['grid']))}, {h} heads, {d}; "
                     f"{doc['dtype']}", fontsize=9, loc="left")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Series": "; ".join(series)})
    plt.close(fig)
    return series


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
    """The usage error for ``--plot`` when matplotlib cannot be imported; None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed in this Python "
                f"({sys.executable}); install it with: {sys.executable} -m pip install matplotlib")
    return None
