"""The bench's progress on stderr: a one-line bar on a terminal, a line per tenth otherwise (logs)."""
from __future__ import annotations

import sys
import time


class Progress:
    """A one-line bar on stderr when it is a terminal; a line per 10% otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.last_decile = -1

    def step(self, label: str, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        elapsed = time.monotonic() - self.t0
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {elapsed:5.0f}s {label[:40]:<40}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(f"bench: {frac:4.0%} after {elapsed:.0f}s ({label})\n")
            self.stream.flush()
