"""How the bench times and summarises: per-call timers (CUDA events on a GPU, ``perf_counter_ns`` on
the CPU), quantiles of the samples, and how busy the rest of the machine was meanwhile."""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolated quantile of already sorted values (p in [0, 1])."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = p * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_s: Sequence[float]) -> Dict[str, float]:
    """Median, p20 and p80 in µs of samples in seconds, and their count."""
    s = sorted(samples_s)
    return {"median_us": quantile(s, 0.5) * 1e6, "p20_us": quantile(s, 0.2) * 1e6,
            "p80_us": quantile(s, 0.8) * 1e6, "samples": len(s)}


class Timer:
    """Per-call times: CUDA events on a GPU, perf_counter_ns on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.method = "cuda-events" if self.cuda else "perf_counter_ns"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], object], n: int) -> Tuple[List[float], float]:
        """Run ``fn`` n times; return the per-call seconds and the wall seconds per call
        (launch-inclusive on a GPU: from the first launch to the end of the last kernel)."""
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n)]
            self.sync()
            t0 = time.perf_counter_ns()
            for start, end in events:
                start.record()
                fn()
                end.record()
            self.sync()
            wall = (time.perf_counter_ns() - t0) * 1e-9 / n
            return [s.elapsed_time(e) * 1e-3 for s, e in events], wall
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) * 1e-9)
        return times, sum(times) / n


def load_average() -> Optional[List[float]]:
    """1, 5 and 15 minute load averages, where the OS has them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


class OtherLoad:
    """CPU time the rest of the machine used while the benchmark ran (Linux /proc/stat less this
    process and its children), as a share of all CPUs: the timings' interference."""

    def __init__(self):
        self.start = self._sample()
        self.t0 = time.monotonic()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float]]:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        busy = (user + nice + system + irq + softirq + steal) / ticks
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system

    def share(self) -> Optional[float]:
        end = self._sample()
        wall = time.monotonic() - self.t0
        if self.start is None or end is None or wall <= 0:
            return None
        others = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(others, 0.0) / (wall * (os.cpu_count() or 1))
