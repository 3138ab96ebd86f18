"""One rank of sd-scripts' Flux attention routed under DDP (tests/test_sd_scripts.py runs two on gloo).

Each rank trains the same tiny Flux-like model (two checkpointed blocks, the T5 mask) on its own data for
two steps under ``DistributedDataParallel``, once with sd-scripts' own attention and once routed, and
reports its parameters' distance between the two runs, a checksum to compare across ranks, its routed
calls and the torch.distributed calls made while routed attention ran outside DDP's own reducer."""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "doubles", "sd_scripts"))

from lib_attn.integrations import sd_scripts  # noqa: E402
from lib_attn.parallel import launch  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "barrier",
               "gather", "scatter", "all_gather_object", "broadcast_object_list")


class Blocks(torch.nn.Module):
    def __init__(self, fm, dim=32, heads=2):
        super().__init__()
        self.fm, self.heads = fm, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def block(self, x, pe, mask):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(self.fm.attention(q, k, v, pe=pe, attn_mask=mask))

    def forward(self, x, pe, mask):
        for _ in range(2):
            x = checkpoint(self.block, x, pe, mask, use_reentrant=False)
        return x


def train(fm, rank, watch=contextlib.nullcontext):
    torch.manual_seed(0)
    model = DistributedDataParallel(Blocks(fm))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    pe = fm.rope(torch.arange(14, dtype=torch.float64)[None].expand(2, -1), 16, 10000)[:, None]
    t5 = torch.ones(2, 4, dtype=torch.long)
    t5[rank % 2, 1 + rank:] = 0
    mask = fm.t5_attn_mask(t5, 10, 2, 14)
    for _ in range(2):
        x = torch.randn(2, 14, 32, generator=gen)
        opt.zero_grad()
        with watch():  # the steps only: DDP's construction may broadcast through the Python API
            model(x, pe, mask).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main():
    rank, world, _ = launch.init(timeout=60)
    import library.flux_models as fm

    plain = train(fm, rank)
    routing = sd_scripts.route()
    counted = {"n": 0}
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(fn):
        def call(*args, **kwargs):
            counted["n"] += 1
            return fn(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def watch():
        for name, fn in real.items():
            setattr(dist, name, counting(fn))
        try:
            yield
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)

    try:
        routed = train(fm, rank, watch)
    finally:
        report = routing.report()
        routing.undo(report=False)
    gathered = [torch.zeros_like(routed) for _ in range(world)]
    dist.all_gather(gathered, routed)
    launch.report({
        "rank": rank,
        "err": float((routed - plain).norm() / plain.norm()),
        "ranks_agree": all(torch.equal(g, routed) for g in gathered),
        "calls": report.total("dit"),
        "recomputed": sum(report.recomputed.values()),
        "collectives": counted["n"],
    })
    launch.finish()


if __name__ == "__main__":
    main()
