"""The parallel configuration: which ranks share one generation, and how they split attention.

``Parallel(ulysses=U, ring=R, group=None)`` lays the W = U x R ranks of ``group`` (the default group
when None) out in a grid: ranks at positions ``g*U .. g*U+U-1`` of the group form Ulysses group ``g``,
and the ranks with the same position modulo U form a ring. Ulysses groups are contiguous so that, with
torchrun's numbering, they stay within one machine (the all-to-all needs the fastest links) and the
ring, whose traffic is point-to-point and can hide behind the kernel, crosses machines.

Making one is collective: every rank of the group must make it, with the same values, in the same
order. On NCCL it makes a group of its ranks with its timeout: over the default group every process
makes it; over a given ``group`` only that group's members do. With both degrees above 1 it makes the
grid's groups with ``torch.distributed.new_group``, which every rank of the default group must call:
then every process of the job makes it, with the same ``group``s in the same order. Groups are made
once per process for given ranks and timeout, and reused by every later configuration.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

#: Modes of a parallel call, from the degrees: all-to-all only, ring only, both on the grid.
MODES = ("ulysses", "ring", "ulysses-ring")
#: What a call does when its head count does not divide the Ulysses degree: ``pad`` adds zero heads
#: (dropped after the call), ``ring`` runs that call as a ring over every rank.
UNEVEN_HEADS = ("pad", "ring")


class ParallelError(RuntimeError):
    """A parallel call failed on this rank or on a peer: names the rank, the mode and what failed."""


def _dist():
    import torch.distributed as dist  # here, not at import: a build without it must still import lib_attn

    if not dist.is_available():
        raise ParallelError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise ParallelError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                            "(torchrun sets the environment it reads) before making a Parallel configuration")
    return dist


@dataclass(eq=False)
class Parallel:
    """Context parallelism over ``group``: ``ulysses`` x ``ring`` = the group's size (one of them may be
    left out; both left out: Ulysses over every rank). ``timeout``: seconds any collective of a call may
    take (on gloo every rank then raises ``ParallelError``; on NCCL the configuration's own group has
    this timeout, and what follows is NCCL's, see docs/parallel.md). ``uneven_heads``: ``pad`` or
    ``ring``."""

    ulysses: int | None = None
    ring: int | None = None
    group: object = None
    timeout: float = 300.0
    uneven_heads: str = "pad"
    rank: int = field(init=False)
    world: int = field(init=False)
    ranks: tuple = field(init=False, repr=False)
    backend: str = field(init=False, repr=False)
    comm_group: object = field(init=False, repr=False)
    ulysses_group: object = field(init=False, repr=False)
    ring_group: object = field(init=False, repr=False)
    ulysses_ranks: tuple = field(init=False, repr=False)
    ring_ranks: tuple = field(init=False, repr=False)

    def __post_init__(self):
        dist = _dist()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.ranks = tuple(dist.get_process_group_ranks(self.group)) if self.group is not None \
            else tuple(range(self.world))
        self.backend = str(dist.get_backend(self.group))
        self.ulysses, self.ring = degrees(self.world, self.ulysses, self.ring)
        if self.uneven_heads not in UNEVEN_HEADS:
            raise ValueError(f"uneven_heads {self.uneven_heads!r} is not one of {', '.join(UNEVEN_HEADS)}")
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"timeout {self.timeout!r} must be a positive number of seconds")
        u = self.ulysses
        self.comm_group = self.group
        if self.backend == "nccl":
            # NCCL bounds each operation by its group's own timeout (its watchdog; a CPU wait with a
            # timeout would hold back the stream): a group of these ranks made with this timeout
            # makes it hold for every collective and ring step of a call. A given subgroup's members
            # alone make it (only they can make this Parallel): local synchronisation, whose name is
            # hashed from the ranks, so pairs of a larger job do not meet on one store key.
            self.comm_group = _group(dist, self.ranks, self.wait_for, local=self.group is not None)
        self.ulysses_group, self.ring_group = self.comm_group, self.comm_group
        self.ulysses_ranks, self.ring_ranks = self.ranks, self.ranks
        if u > 1 and self.ring > 1:
            # Every rank creates every subgroup, in the same order: new_group is collective. Not local
            # synchronisation: torch warns it can deadlock when a rank makes several overlapping groups.
            for g in range(self.ring):
                ranks = self.ranks[g * u:(g + 1) * u]
                made = _group(dist, ranks, self.wait_for, local=False)
                if self.rank // u == g:
                    self.ulysses_group, self.ulysses_ranks = made, ranks
            for p in range(u):
                ranks = self.ranks[p::u]
                made = _group(dist, ranks, self.wait_for, local=False)
                if self.rank % u == p:
                    self.ring_group, self.ring_ranks = made, ranks

    @property
    def mode(self) -> str:
        if self.ulysses > 1 and self.ring > 1:
            return "ulysses-ring"
        return "ring" if self.ring > 1 else "ulysses"

    @property
    def wait_for(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def describe(self) -> str:
        return f"{self.mode} over {self.world} ranks (ulysses {self.ulysses} x ring {self.ring}, {self.backend})"


#: Groups made for configurations, by (default group, ranks, timeout, local): a NCCL group holds a
#: communicator and its GPU buffers until the process ends, so a Parallel made per generation reuses
#: the groups of the first one instead of adding its own.
_groups: dict = {}


def _group(dist, ranks: tuple, timeout: datetime.timedelta, local: bool):
    key = (dist.group.WORLD, tuple(ranks), timeout, local)
    if key not in _groups:
        extra = {"use_local_synchronization": True} if local else {}
        _groups[key] = dist.new_group(list(ranks), timeout=timeout, **extra)
    return _groups[key]


def degrees(world: int, ulysses: int | None, ring: int | None) -> tuple[int, int]:
    """(ulysses, ring) for ``world`` ranks, one of them possibly left out (None); both left out: Ulysses
    over every rank. Raises ValueError naming the values when they do not multiply to ``world``."""
    for name, value in (("ulysses", ulysses), ("ring", ring)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} degree {value!r} must be a positive integer")
    if ulysses is None and ring is None:
        return world, 1
    given = f"ulysses={ulysses}, ring={ring}"
    if ulysses is None:
        ulysses = world // ring if world % ring == 0 else 0
    if ring is None:
        ring = world // ulysses if world % ulysses == 0 else 0
    if ulysses * ring != world:
        valid = ", ".join(f"{u}x{world // u}" for u in range(1, world + 1) if world % u == 0)
        raise ValueError(f"ulysses x ring must equal the {world} ranks of the group; got {given}; "
                         f"valid (ulysses x ring): {valid}")
    return ulysses, ring
