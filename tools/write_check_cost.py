"""What the guard's write check costs at a video-length call: the fingerprints of q, k and v
(``check.checksums``, taken before and after a kernel's first full-size run) against the single
wrapping 32-bit sum of their words they replaced, and the copies in host memory a first check keeps.

    python tools/write_check_cost.py DTYPE TOKENS [HEADS [HEAD_DIM]]

DTYPE: bf16, fp16 or fp32. The inputs are made as diffusers hands them (bshd, seen as bhsd):
Wan 2.2's 720p self-attention is ``bf16 75600 40 128`` (738 MiB per input); ``fp32 37800`` has the
same bytes. Prints the first run of each and the medians of five interleaved runs, in seconds, and
the peak resident memory the copies add.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time

import torch

from lib_attn import check

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def wrapping_sums(*tensors) -> list:
    """The check before: one wrapping 32-bit sum of each tensor's words."""
    return [t.view(torch.int32).sum(dtype=torch.int32) for t in tensors]


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list) -> int:
    dtype = DTYPES[argv[0]]
    tokens = int(argv[1])
    heads = int(argv[2]) if len(argv) > 2 else 40
    head_dim = int(argv[3]) if len(argv) > 3 else 128
    qkv = [torch.randn(1, tokens, heads, head_dim, dtype=dtype).transpose(1, 2) for _ in range(3)]
    mib = qkv[0].numel() * qkv[0].element_size() / 2**20
    print(f"{argv[0]} 1×{heads}×{tokens}×{head_dim}: {mib:.0f} MiB per input, {torch.get_num_threads()} threads")
    first = {"wrapping sums": seconds(lambda: wrapping_sums(*qkv)), "fingerprints": seconds(lambda: check.checksums(*qkv))}
    steady = {name: [] for name in first}
    for _ in range(5):
        steady["wrapping sums"].append(seconds(lambda: wrapping_sums(*qkv)))
        steady["fingerprints"].append(seconds(lambda: check.checksums(*qkv)))
    for name, runs in steady.items():
        print(f"  {name} of q, k, v: first {first[name]:.3f} s, median {statistics.median(runs):.3f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    copies = seconds(lambda: check._host_copies(qkv))
    added = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    print(f"  copies in host memory: {copies:.3f} s, peak resident memory +{added:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
