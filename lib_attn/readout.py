"""What every host shows of a report, and what a script prints: the text of each of its parts, the plain
lines of hosts that have no readout convention of their own (ComfyUI's Attention report node and server
message, a diffusers script: ``print(lib_attn.readout.text(lib_attn.Report.from_recording(rec)))``), and
the report's JSON with them.

Each part is rendered here, from the report's data (``lib_attn.report``): the kernels that ran per
role (``kernel_text``, ``role_mark``), the calls per schedule rule (``schedule_text``), what sparse
attention did (``sparse_lines``), each fallback
with the backends passed over after it (``fallback_line``), what the guard caught (``guard_lines``).
The webuis lay the same parts out as their readout and infotext, in A1111's terms
(``webui_attn.ui.readout``).
"""
from __future__ import annotations

import re

from lib_attn.report import MIB, Report

ROLE_NAMES = {"unet": "UNet", "dit": "DiT", "vae": "VAE", "text": "Text"}
#: A role's mark before what it ran, in a line that lists several roles; the denoiser (UNet or DiT) has none.
ROLE_MARKS = {"unet": "", "dit": "", "vae": "VAE", "text": "Text"}
#: After a backend's description where tuning chose it (measured on this machine, or stored).
TUNED_MARK = " [tuned]"
#: The name of the line (and of the webuis' infotext entry) that counts the calls per schedule rule.
SCHEDULE_KEY = "Attention schedule"


def one_line(text) -> str:
    """A reason on one line (and so an infotext value that parses back)."""
    return " ".join(str(text).split())


def role_mark(report: Report, role: str) -> str:
    """``"VAE "`` before the VAE's part of a line, ``""`` before the denoiser's, ``"DiT "`` where a UNet
    ran too (both denoisers ran: keep them apart)."""
    mark = ROLE_MARKS.get(role, role)
    if role == "dit" and any(r == "unet" for r, _ in report.calls):
        mark = "DiT"
    return mark + " " if mark else ""


def kernel_text(report: Report, role: str, backend: str) -> str:
    """The kernel that ran, with its version, and the tuned mark: ``flash-attn 2.8.3 (FA3) [tuned]``."""
    return report.describe(backend) + (TUNED_MARK if report.is_tuned(role, backend) else "")


def _range_text(label: str) -> str:
    return re.sub(r"(\d)-(\d)", "\\1–\\2", label)


def schedule_text(report: Report) -> str:
    """The calls per schedule rule, in the schedule's order: ``0–20%: sdpa ×128 · 20–80%: sage ×384 ·
    80–100%: sdpa ×128 · otherwise: VAE sdpa ×2``; they add up to the calls the report counts."""
    parts = []
    for schedule in report.schedules:
        for label, items in report.rule_items(schedule):
            ran = " + ".join(f"{role_mark(report, role)}{b} ×{n:,}" for role, b, n in items)
            parts.append(f"{_range_text(label)}: {ran}")
    return " · ".join(parts)


def guard_lines(report: Report) -> list[str]:
    """What the guard caught, one line each: ``guard: sage ×3 non-finite values → sdpa (recomputed)``,
    ``guard: sage rejected for unet 2×8×4096×77×40 fp16: rel err 2.8e-01 > 8.0e-02 → sdpa (recomputed)``."""
    lines = []
    for (role, backend, what, ran_on, recomputed), n in report.guard_items():
        count = f" ×{n:,}" if n > 1 or not what.startswith("rejected") else ""
        done = "recomputed" if recomputed else "found after it returned: not recomputed"
        lines.append(f"guard: {backend}{count} {what} → {ran_on} ({done})")
    return lines


def fallback_line(report: Report, key: tuple, n: int) -> str:
    """``fallback UNet flash-attn ×64: <why>; then sdpa-cudnn: <why>; ran sdpa``: every backend passed
    over, in the order tried, and what took the calls."""
    role, backend, reason = key
    others, ran = report.path(key)
    parts = [f"fallback {ROLE_NAMES.get(role, role)} {backend} ×{n:,}: {one_line(reason)}"]
    parts += [f"then {other}: {one_line(why)}" for other, why in others]
    if ran:
        parts.append(f"ran {', '.join(ran)}")
    return "; ".join(parts)


#: The call kinds of sparse attention a readout lists one by one (most calls first); the rest are counted.
SPARSE_KINDS_SHOWN = 4


def _error(x) -> str:
    return "–" if x is None else f"{x:.1e}"


def _measured_text(sparse, where=None) -> str:
    """``kept 21%, error max 1.1e-01 / typical 9.0e-02`` of the measured calls (of one kind, ``where``)."""
    kept = sparse.kept_share(where)
    parts = [f"kept {kept:.0%}"] if kept is not None else []
    if sparse.error_max(where) is not None:
        parts.append(f"error max {_error(sparse.error_max(where))} / typical {_error(sparse.error_typical(where))}")
    return ", ".join(parts)


def sparse_lines(report: Report) -> list[str]:
    """What sparse attention did: ``sparse ×1,200 (block-sparse, budget=0.15, …): blocks kept 21%, error
    max 1.2e-01 / typical 9.0e-02 against budget 1.5e-01 (310 measured)``, one line per call kind (the
    most served first: ``sparse DiT block-sparse block 3, 20–40% at topk 0.2 ×8: kept 21%, error max …``),
    the calls that ran dense while it was on by reason, and the time split where it was measured."""
    sparse = report.sparse
    if sparse is None:
        return []
    summary = _measured_text(sparse)
    head = f"sparse ×{sparse.calls:,} ({sparse.settings})"
    if summary:
        head += f": blocks {summary}"
    if sparse.budget is not None:
        head += f" against budget {_error(sparse.budget)} ({sparse.measured:,} measured)"
    out = [head]
    items = sparse.kind_items()
    for (role, backend, kind, setting), n in items[:SPARSE_KINDS_SHOWN]:
        line = f"sparse {ROLE_NAMES.get(role, role)} {backend} {_range_text(kind)} at {setting} ×{n:,}"
        detail = _measured_text(sparse, (role, backend, kind, setting))
        out.append(f"{line}: {detail}" if detail else line)
    if len(items) > SPARSE_KINDS_SHOWN:
        rest = items[SPARSE_KINDS_SHOWN:]
        out.append(f"sparse: {len(rest)} more call kinds ×{sum(n for _, n in rest):,}")
    if sparse.replaced:
        out.append(f"sparse outputs measured over the budget, recomputed: ×{sparse.replaced_calls:,} "
                   f"(error max {_error(sparse.replaced_error_max())})")
    if sparse.dense:
        out.append("dense while sparse was on: " + " · ".join(
            f"{ROLE_NAMES.get(role, role)} ×{n:,} {one_line(reason)}" for (role, reason), n in sparse.dense_items()))
    if sparse.seconds:
        out.append("sparse time: " + " · ".join(f"{part} {seconds:.2f} s" for part, seconds in sorted(sparse.seconds.items())))
    return out


def _gib(n: int) -> str:
    return f"{n / (1024 * MIB):.2f} GiB"


def vram_text(vram) -> str:
    """``peak VRAM: allocated 3.21 GiB / reserved 4.00 GiB / device 5.62 of 80.00 GiB``; a ``≤`` marks
    peaks that only bound this run's (torch's counters were not reset for it and did not rise)."""
    bound = "≤" if vram.peaks_bounded else ""
    return (f"peak VRAM: allocated {bound}{_gib(vram.active_peak)} / reserved {bound}{_gib(vram.reserved_peak)} / "
            f"device {_gib(vram.system_peak)} of {_gib(vram.total)}")


def lines(report: Report) -> list[str]:
    """One line per role that ran (most calls first), the calls per schedule rule (``Attention schedule:
    0–50%: sdpa ×32 · 50–100%: math ×32``, adding up to the calls above) when a schedule served calls,
    what sparse attention did (``sparse_lines``), one line per fallback, one per thing the guard caught, then time, memory and notes."""
    out = [f"{ROLE_NAMES.get(role, role)}: " + ", ".join(f"{kernel_text(report, role, b)} ×{n:,}"
                                                          for b, n in report.backends(role))
           for role in report.roles()]
    if not out:
        out.append(f"{report.ran_on}, not through this extension" if report.ran_on else "no attention calls")
    if report.rules:
        out.append(f"{SCHEDULE_KEY}: {schedule_text(report)}")
    out += sparse_lines(report)
    out += [fallback_line(report, key, n) for key, n in report.fallback_items()]
    out += guard_lines(report)
    facts = []
    if report.seconds is not None:
        facts.append(f"time {report.seconds:.1f} s")
    if report.vram is not None:
        facts.append(vram_text(report.vram))
    if facts:
        out.append(" · ".join(facts))
    out.extend(f"note: {note}" for note in (*report.notes, *([report.hint] if report.hint else ())))
    return out


def text(report: Report) -> str:
    return "\n".join(lines(report))


def to_json(report: Report) -> dict:
    """The report's data plus these lines (``text``): what a host's status route and messages carry."""
    return dict(report.to_dict(), text=lines(report))
