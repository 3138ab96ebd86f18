"""The bench's progress on stderr: a one-line bar on a terminal, a line per tenth otherwise (logs)."""
from __future__ import annotations

import sys
import time


#: Otherwise, a line at least this often (seconds) while steps come, and at the start of a long part.
EVERY_S = 10.0


class Progress:
    """A one-line bar on stderr when it is a terminal; otherwise a line per 10%, and one whenever
    ``EVERY_S`` seconds have passed since the last (a long part: the memory runs, the overhead)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, clock=time.monotonic):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.clock = clock
        self.t0 = self.last_line = clock()
        self.last_decile = -1

    def starting(self, label: str) -> None:
        """A part that may take a while begins (``label``): said now, as a step of none."""
        self.step(label, 0, at_once=True)

    def step(self, label: str, n: int = 1, at_once: bool = False) -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        now = self.clock()
        elapsed = now - self.t0
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {elapsed:5.0f}s {label[:40]:<40}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 10) > self.last_decile or at_once or now - self.last_line >= EVERY_S:
            self.last_decile = max(self.last_decile, int(frac * 10))
            self.last_line = now
            self.stream.write(f"bench: {frac:4.0%} after {elapsed:.0f}s ({label})\n")
            self.stream.flush()
