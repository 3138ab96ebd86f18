"""What block-sparse's FlexAttention design compiles, call by call, in this (fresh) process: the graphs
``torch.compile`` builds (``torch._dynamo``'s count of unique graphs) and the time of each call, at a
first shape, the same shape again, then other shapes.

    python tools/flex_compiles.py routed|pooled [DEVICE]

``routed``: the routed blocks alone; ``pooled``: with the pooled rows (what ``block-sparse`` runs).
DEVICE: cpu (default) or cuda. Inputs: (1, 2 heads, n, 64) random, fp32 on a CPU and bf16 on CUDA,
top-k 0.2 of 128-token blocks. Prints one line per call; a call the compiler fails is printed with the
error's first line (the engine then runs the gather design for that device, dtype and head dim).
"""
from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import counters

from lib_attn.kernels.block_sparse import flex
from lib_attn.kernels.block_sparse.routing import route

SHAPES = (4096, 4096, 8192, 6144, 12288, 8192)


def main(argv: list) -> int:
    pooled = argv[0] == "pooled"
    device = argv[1] if len(argv) > 1 else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, "
          f"{'pooled rows' if pooled else 'routed blocks alone'}")
    g = torch.Generator(device).manual_seed(0)
    for n in SHAPES:
        q, k, v = (torch.randn(1, 2, n, 64, generator=g, device=device, dtype=dtype) for _ in range(3))
        routing = route(q, k, 64 ** -0.5, 128, "topk", 0.2, pooled)
        before, start = counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            flex.run(q, k, v, 64 ** -0.5, routing, 128)
            if device == "cuda":
                torch.cuda.synchronize()
            result = "ran"
        except Exception as exc:  # noqa: BLE001 - what the compiler says is the measurement
            result = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
        graphs = counters["stats"]["unique_graphs"] - before
        print(f"{n:>6} tokens: {graphs} graph(s) compiled, {time.perf_counter() - start:.1f} s, {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
