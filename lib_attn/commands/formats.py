"""How the commands' text reports print values: aligned plain-text tables, times, significant
figures, and '-' for a missing version."""
from __future__ import annotations

from typing import List, Optional


def format_table(headers: List[str], rows: List[List[str]], right_from: int = 1) -> str:
    """Columns separated by two spaces under a dashed rule; columns from ``right_from`` on are
    right-aligned (the numbers), those before it left-aligned (the labels)."""
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]

    def line(r):
        return "  ".join(str(x).rjust(w) if i >= right_from else str(x).ljust(w)
                         for i, (x, w) in enumerate(zip(r, widths))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def fmt_time(us: Optional[float]) -> str:
    """Microseconds as µs or ms with three or four significant digits; '-' for None."""
    if us is None:
        return "-"
    if us >= 1e5:
        return f"{us / 1e3:.0f} ms"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"


def fmt_sig(x: Optional[float], digits: int = 3) -> str:
    """``digits`` significant figures; exponent form below 0.001; '-' for None."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 else f"{x:.1e}"


def shown(value) -> str:
    """A version as the text reports print it: '-' when there is none."""
    return "-" if value is None else str(value)
