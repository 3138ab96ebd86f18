"""The first call of a signature against a steady one, in this (fresh) process: time and the peak
extra resident memory over the memory in use before each call, the call's own output not counted.

    MALLOC_MMAP_THRESHOLD_=65536 python tools/first_call.py B,H,Q,KV,D [GUARD [TUNE]]

GUARD: on (default), full or off; TUNE: off (default) or on. Prints one JSON line. Linux only (it
resets and reads the resident-set high-water mark through /proc, as ``bench`` does); with
MALLOC_MMAP_THRESHOLD_ glibc returns every block of 64 KiB or more on free, so earlier frees do not
hide the peak. Before the measured calls, one call of another shape loads the kernel.
"""
from __future__ import annotations

import gc
import json
import sys
import time

import torch

import lib_attn
from lib_attn.commands.bench.memory import _reset_rss_peak, _status_kib


def main(argv: list) -> int:
    b, h, n, kv, d = (int(x) for x in argv[0].split(","))
    guard = argv[1] if len(argv) > 1 else "on"
    tune = argv[2] if len(argv) > 2 else "off"
    lib_attn.configure(guard=guard, tune=tune)
    lib_attn.attention(*(torch.randn(1, 1, 64, d) for _ in range(3)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, d, generator=g)
    k, v = torch.randn(b, h, kv, d, generator=g), torch.randn(b, h, kv, d, generator=g)
    output_mib = q.numel() * q.element_size() / 2**20
    result = {"shape": [b, h, n, kv, d], "guard": guard, "tune": tune, "input_mib": output_mib}
    for name in ("first", "steady"):
        gc.collect()
        before = _status_kib("VmRSS")
        _reset_rss_peak()
        t0 = time.perf_counter()
        out = lib_attn.attention(q, k, v)
        result[f"{name}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        result[f"{name}_extra_mib"] = round((_status_kib("VmHWM") - before) / 1024 - output_mib, 2)
        del out
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
