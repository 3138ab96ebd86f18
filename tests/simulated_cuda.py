"""A CUDA device simulated behind torch.cuda's memory queries, for code that measures VRAM on a CPU box.

It keeps what the caching allocator and the driver would: bytes in use by tensors (``active``), bytes the
allocator holds (``reserved``, which grows to cover what is active and only shrinks on ``empty_cache``),
their peaks since the last ``reset_peak_memory_stats``, and the device's free memory, which other
processes (and the CUDA context) take from too. ``install`` puts it behind ``torch.cuda.is_available``,
``current_device``, ``memory_stats``, ``mem_get_info``, ``reset_peak_memory_stats`` and ``empty_cache``.
Every query and change holds one lock, as the real counters are read whole.
"""
from __future__ import annotations

import threading

import torch

GIB = 1024 ** 3


class SimulatedDevice:
    def __init__(self, total=80 * GIB, others=2 * GIB):
        self.total = total
        self.others = others         # other processes and the CUDA context
        self.active = 0
        self.reserved = 0
        self.active_peak = 0
        self.reserved_peak = 0
        self.resets = 0
        self._lock = threading.Lock()

    # --- what the program does -----------------------------------------------------------------------
    def alloc(self, n: int) -> None:
        with self._lock:
            self.active += n
            self.reserved = max(self.reserved, self.active)
            self.active_peak = max(self.active_peak, self.active)
            self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n: int) -> None:
        with self._lock:
            self.active -= n

    # --- torch.cuda ---------------------------------------------------------------------------------
    def memory_stats(self, device=None) -> dict:
        with self._lock:
            return {"active.all.current": 1 if self.active else 0, "active_bytes.all.current": self.active,
                    "active_bytes.all.peak": self.active_peak, "allocated_bytes.all.peak": self.active_peak,
                    "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.reserved_peak}

    def mem_get_info(self, device=None) -> tuple[int, int]:
        with self._lock:
            return self.total - self.others - self.reserved, self.total

    def reset_peak_memory_stats(self, device=None) -> None:
        with self._lock:
            self.active_peak = self.active
            self.reserved_peak = self.reserved
            self.resets += 1

    def empty_cache(self) -> None:
        with self._lock:
            self.reserved = self.active

    def install(self, monkeypatch) -> "SimulatedDevice":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.memory_stats)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        return self
