"""Context parallelism: one attention call split over several processes (ranks) on torch.distributed.

    import torch.distributed as dist
    from lib_attn import parallel

    dist.init_process_group("nccl")                     # torchrun sets rank and world size
    par = parallel.Parallel(ulysses=4, ring=2)          # 8 ranks; made on every rank of its group alone
    with parallel.use(par):
        out = parallel.attention(q, k, v, kind="joint", text_len=512)   # this rank's share

Modes: Ulysses (all-to-all, sequence split -> head split), ring (keys and values passed round, outputs
merged by log-sum-exp), or both on a grid of ranks (``mesh``). The local kernel of every step is the
engine's choice for that call (``local``). The sharding convention: ``sharding``. Nothing here runs,
or imports torch.distributed, until a configuration is made.
"""
from .attend import KINDS, attention, configure, current, use
from .local import can_return_lse
from .mesh import MODES, UNEVEN_HEADS, Parallel, ParallelError, degrees
from .sharding import bounds, gather, shard, sizes

__all__ = ["Parallel", "ParallelError", "attention", "configure", "use", "current", "shard", "gather", "sizes",
           "bounds", "degrees", "can_return_lse", "KINDS", "MODES", "UNEVEN_HEADS"]
