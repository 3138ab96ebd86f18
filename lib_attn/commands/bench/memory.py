"""Peak extra memory of one attention call, over the memory in use before it: the first call of its
signature (the guard's first check runs there, and the auto column's tuning) and a steady call.

On CUDA: the allocator's peak after ``reset_peak_memory_stats`` over ``memory_allocated`` before the
call. On the CPU: the resident-set high-water mark (Linux ``/proc/self/clear_refs`` resets it) over
the resident set before the call, each cell's two calls in a fresh subprocess whose glibc returns
every block of 64 KiB or more to the OS on free, so that what earlier calls freed does not hide the
peak. The output tensor is included either way.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Callable, List, Optional, Tuple

import torch

import lib_attn
from lib_attn import shapes

from ..dtypes import parse_dtype
from .cells import first_line
from .inputs import make_inputs

MIB = 1024 * 1024
CPU_MEMORY_METHOD = ("RSS high-water mark (/proc/self/clear_refs + VmHWM) over RSS before the call, "
                     "the first and a steady call per cell in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536; "
                     "output tensor included")
CUDA_MEMORY_METHOD = ("torch.cuda max_memory_allocated after reset_peak_memory_stats, over "
                      "memory_allocated before the call; output tensor included")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def cpu_peak_supported() -> bool:
    """Whether this OS lets a process reset and read its resident-set high-water mark (Linux)."""
    try:
        _reset_rss_peak()
        _status_kib("VmHWM")
        return True
    except (OSError, KeyError):
        return False


def cuda_peak(fn: Callable[[], object], device: torch.device) -> Tuple[object, float]:
    """``fn()``'s result and the MiB the allocator's peak rose during it over what was allocated before it."""
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, (torch.cuda.max_memory_allocated(device) - before) / MIB


def _worker() -> None:
    """Subprocess entry: cells as JSON on stdin; one JSON line per cell on stdout."""
    spec = json.load(sys.stdin)
    torch.set_num_threads(spec["threads"])
    lib_attn.configure(tune=spec.get("tune", "auto"))  # the parent's rankings, read from the tuning file
    cpu = torch.device("cpu")
    warmed = set()
    for cell in spec["cells"]:
        call = shapes.AttentionCall(**cell["call"])
        dtype = parse_dtype(cell["dtype"])
        backend = cell["backend"]
        try:
            key = (backend, cell["dtype"], call.head_dim, call.role)
            if key not in warmed:  # one-time lazy initialisation is not per-call memory
                tiny = shapes.AttentionCall(call.model, call.res, "warm-up", "self", call.role,
                                            1, 1, 64, 64, call.head_dim, 1)
                lib_attn.attention(*make_inputs(tiny, dtype, cpu), role=call.role, backend=backend)
                warmed.add(key)
            q, k, v = make_inputs(call, dtype, cpu)
            result = {}
            for name in ("first_call_extra_bytes", "peak_extra_bytes"):  # the signature's first call, then a steady one
                gc.collect()
                before = _status_kib("VmRSS")
                _reset_rss_peak()
                out = lib_attn.attention(q, k, v, role=call.role, backend=backend)
                peak = _status_kib("VmHWM")
                del out
                result[name] = max(peak - before, 0) * 1024
            del q, k, v
        except (RuntimeError, ValueError, MemoryError) as exc:
            result = {"error": first_line(exc)}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def measure_cpu_memory(jobs: List[Tuple[shapes.AttentionCall, str, Optional[str]]],
                       on_result: Optional[Callable[[int], None]] = None) -> List[dict]:
    """Peak extra bytes of the first and of a steady call per job ``(call, dtype name, backend or
    None)``, measured in a fresh subprocess (see ``CPU_MEMORY_METHOD``)."""
    if not jobs:
        return []
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(lib_attn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = package_root + os.pathsep + env.get("PYTHONPATH", "")
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks leave the resident set at once
    payload = {"threads": torch.get_num_threads(), "tune": lib_attn.config().tune,
               "cells": [{"call": asdict(c), "dtype": d, "backend": b} for c, d, b in jobs]}
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen([sys.executable, "-c", "from lib_attn.commands.bench.memory import _worker; "
                                 "_worker()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, text=True, env=env)
        proc.stdin.write(json.dumps(payload))
        proc.stdin.close()
        results: List[dict] = []
        for line in proc.stdout:
            results.append(json.loads(line))
            if on_result:
                on_result(len(results) - 1)
        proc.wait()
        errors.seek(0)
        err = errors.read()
    if len(results) < len(jobs):
        tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        results += [{"error": f"memory subprocess failed: {tail}"}] * (len(jobs) - len(results))
    return results
