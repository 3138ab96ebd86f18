"""A report as ComfyUI shows it: a few plain lines on the Attention report node and in the server
message, with the same content as the webuis' readout (kernels × calls, fallbacks with reasons,
time, peak VRAM as allocated / reserved / device)."""
from __future__ import annotations

from lib_attn.report import MIB, Report
from webui_attn.readout import INFOTEXT_SCHEDULE_KEY, schedule_text

ROLE_NAMES = {"unet": "UNet", "dit": "DiT", "vae": "VAE", "text": "Text"}


def _gib(n: int) -> str:
    return f"{n / (1024 * MIB):.2f} GiB"


def vram_text(vram) -> str:
    """``peak VRAM: allocated 3.21 GiB / reserved 4.00 GiB / device 5.62 of 80.00 GiB``; a ``≤`` marks
    peaks that only bound this run's (torch's counters were not reset for it and did not rise)."""
    bound = "≤" if vram.peaks_bounded else ""
    return (f"peak VRAM: allocated {bound}{_gib(vram.active_peak)} / reserved {bound}{_gib(vram.reserved_peak)} / "
            f"device {_gib(vram.system_peak)} of {_gib(vram.total)}")


def _plain(reason) -> str:
    return " ".join(str(reason).split())


def fallback_line(report: Report, key: tuple, n: int) -> str:
    """``fallback UNet flash-attn ×64: <why>; then sdpa-cudnn: <why>; ran sdpa``: every backend passed
    over, in the order tried, and what took the calls."""
    role, backend, reason = key
    others, ran = report.path(key)
    parts = [f"fallback {ROLE_NAMES.get(role, role)} {backend} ×{n:,}: {_plain(reason)}"]
    parts += [f"then {other}: {_plain(why)}" for other, why in others]
    if ran:
        parts.append(f"ran {', '.join(ran)}")
    return "; ".join(parts)


def lines(report: Report) -> list[str]:
    """One line per role that ran (most calls first), the calls per schedule rule (``Attention schedule:
    0–50%: sdpa ×32 · 50–100%: math ×32``, adding up to the calls above) when a schedule served calls,
    one line per fallback, one per thing the guard caught, then time, memory and notes."""
    out = []
    for role in report.roles():
        ran = ", ".join(f"{report.describe(b)}{' [tuned]' if report.is_tuned(role, b) else ''} ×{n:,}"
                        for b, n in report.backends(role))
        out.append(f"{ROLE_NAMES.get(role, role)}: {ran}")
    if not out:
        out.append(f"{report.ran_on}, not through this extension" if report.ran_on else "no attention calls")
    if report.rules:
        out.append(f"{INFOTEXT_SCHEDULE_KEY}: {schedule_text(report)}")
    for key, n in report.fallback_items():
        out.append(fallback_line(report, key, n))
    out.extend(report.guard_lines())
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
    """The report's data plus ComfyUI's text of it (what the status route and the server message carry)."""
    return dict(report.to_dict(), text=lines(report))
