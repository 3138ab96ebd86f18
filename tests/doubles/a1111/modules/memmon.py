"""Double of modules/memmon.py: MemUsageMonitor with A1111's keys; disabled without CUDA, as the real one.

Tests may call ``inject(stats)`` to make ``read()``/``stop()`` return given byte counts without a GPU.
"""
import threading
from collections import defaultdict

import torch

KEYS = ("free", "total", "active", "active_peak", "reserved", "reserved_peak", "system_peak", "min_free")


class MemUsageMonitor(threading.Thread):
    def __init__(self, name, device, opts):
        threading.Thread.__init__(self, name=name, daemon=True)
        self.device = device
        self.opts = opts
        self.data = defaultdict(int)
        self.disabled = not torch.cuda.is_available()
        self.run_flag = threading.Event()  # set while a generation is measured, as in A1111
        self._injected = None

    def monitor(self):
        # A1111's polling thread resets the peaks and clears data once the flag is set.
        self.data.clear()
        self.run_flag.set()

    def inject(self, stats):
        self._injected = dict(stats)
        self.disabled = False

    def read(self):
        if self._injected is not None:
            self.data.update(self._injected)
        elif not self.disabled:
            free, total = torch.cuda.mem_get_info()
            self.data["free"] = free
            self.data["total"] = total
            stats = torch.cuda.memory_stats(self.device)
            self.data["active"] = stats["active.all.current"]
            self.data["active_peak"] = stats["active_bytes.all.peak"]
            self.data["reserved"] = stats["reserved_bytes.all.current"]
            self.data["reserved_peak"] = stats["reserved_bytes.all.peak"]
            self.data["system_peak"] = total - self.data.get("min_free", free)
        return self.data

    def stop(self):
        self.run_flag.clear()
        return self.read()
