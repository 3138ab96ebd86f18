"""Peak memory of one context-parallel call on each rank, beyond its inputs and its output, in units of
one rank's q shard: ``python tools/parallel_peak_memory.py [--ranks 2] [--dtype bf16]``.

Runs on CPU over gloo (it starts its own ranks). The peak is the process's resident high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``) over what was resident before the call, with
glibc made to map every buffer above 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so that a freed
buffer leaves at once. The local kernel's own workspace is included. Linux only.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Many heads, few tokens: buffers of tens of MiB for little compute (the peak counts buffers, not FLOPs).
SHAPE = (1, 2048, 256, 64)


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_main(dtype_name: str) -> None:
    import torch

    from lib_attn import parallel
    from lib_attn.parallel import launch

    rank, world, _ = launch.init(timeout=120)
    b, h, n, d = SHAPE
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, DTYPES[dtype_name])
    shard = [torch.randn(b, h, n // world, d, generator=gen).to(dtype) for _ in range(3)]
    unit = shard[0].numel() * shard[0].element_size()
    peaks = {}
    for u in [u for u in range(1, world + 1) if world % u == 0]:
        par = parallel.Parallel(ulysses=u, ring=world // u, timeout=120)
        parallel.attention(*shard, kind="self", parallel=par)  # decisions made, buffers warm
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before = _status("VmRSS")
        out = parallel.attention(*shard, kind="self", parallel=par)
        peaks[par.mode + f" {u}x{world // u}"] = (_status("VmHWM") - before - out.numel() * out.element_size()) / unit
    launch.report({"rank": rank, "peaks": peaks, "shard_mib": unit / 2**20})
    launch.finish()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    from lib_attn.parallel import launch

    ranks = launch.run_ranks(args.ranks, [os.path.abspath(__file__), "--rank-main", args.dtype], timeout=600,
                             env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    failed = [r for r in ranks if r["returncode"] != 0 or not r["result"]]
    for r in failed:
        print(f"rank {r['rank']} failed:\n{r['output']}", file=sys.stderr)
    if failed:
        return 1
    b, h, n, d = SHAPE
    print(f"{args.ranks} ranks, {args.dtype}, call (b, h, n, d) = {SHAPE}; one q shard = "
          f"{ranks[0]['result']['shard_mib']:.0f} MiB; peak beyond inputs and output, in q shards:")
    for mode in ranks[0]["result"]["peaks"]:
        print(f"  {mode:<20} " + "  ".join(f"rank {r['rank']}: {r['result']['peaks'][mode]:.2f}" for r in ranks))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2])
    else:
        sys.exit(main())
