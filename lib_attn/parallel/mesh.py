"""The parallel configuration: which ranks share one generation, and how they split attention.

``Parallel(ulysses=U, ring=R, group=None)`` lays the W = U x R ranks of ``group`` (the default group
when None) out in a grid: ranks at positions ``g*U .. g*U+U-1`` of the group form Ulysses group ``g``,
and the ranks with the same position modulo U form a ring. Ulysses groups are contiguous so that, with
torchrun's numbering, they stay within one machine (the all-to-all needs the fastest links) and the
ring, whose traffic is point-to-point and can hide behind the kernel, crosses machines.

Who makes what: the members of ``group``, and they alone, make the configuration, with the same values,
in the same order (a process outside ``group`` makes nothing for it). Each configuration communicates
over groups of its own, its channel: one over its ranks, and, with both degrees above 1, this rank's
Ulysses group and ring. Each is made by its members alone (``use_local_synchronization``) under a name
derived from its ranks, its configuration (degrees, timeout, backend) and its channel number, so the
members of a group name it alike whatever else each process made before, and groups of sub-jobs of one
world never meet on one store key.

Channels: a configuration takes the lowest channel number not held by another live configuration of
the same ranks and values, and gives it back when it is no longer referenced (configurations held only
by reference cycles are collected first, so every rank frees the same ones). Two configurations in use
at once (two pipelines in two threads) so never share a group; one made again per generation reuses the
groups of the one before it (a NCCL group holds a communicator and its GPU buffers until the process
ends, or until ``torch.distributed.destroy_process_group``, after which it is made anew).
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import threading
import weakref
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
    take (on gloo every rank then raises ``ParallelError``; on NCCL the configuration's own groups have
    this timeout, and what follows is NCCL's, see docs/parallel.md). ``uneven_heads``: ``pad`` or
    ``ring``. Made by the members of ``group`` alone (see the module's docstring)."""

    ulysses: int | None = None
    ring: int | None = None
    group: object = None
    timeout: float = 300.0
    uneven_heads: str = "pad"
    rank: int = field(init=False)
    world: int = field(init=False)
    ranks: tuple = field(init=False, repr=False)
    backend: str = field(init=False, repr=False)
    backends: dict = field(init=False, repr=False)
    channel: int = field(init=False, repr=False)
    comm_group: object = field(init=False, repr=False)
    ulysses_group: object = field(init=False, repr=False)
    ring_group: object = field(init=False, repr=False)
    ulysses_ranks: tuple = field(init=False, repr=False)
    ring_ranks: tuple = field(init=False, repr=False)

    def __post_init__(self):
        dist = _dist()
        if self.uneven_heads not in UNEVEN_HEADS:
            raise ValueError(f"uneven_heads {self.uneven_heads!r} is not one of {', '.join(UNEVEN_HEADS)}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or self.timeout <= 0:
            raise ValueError(f"timeout {self.timeout!r} must be a positive number of seconds")
        if self.group is not None and self.group not in _c10d()._world.pg_group_ranks:
            raise ParallelError(f"group {self.group!r} is not a process group this process belongs to: the members "
                                f"of a group make a configuration over it, and they alone")
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.ranks = tuple(dist.get_process_group_ranks(self.group)) if self.group is not None \
            else tuple(range(self.world))
        self.backends = device_backends(dist.get_backend_config(self.group))
        made_with = str(dist.get_backend(self.group))
        self.backend = describe_backends(self.backends)
        self.ulysses, self.ring = degrees(self.world, self.ulysses, self.ring)
        self._held = _Held(self)
        self.channel = -1
        self.comm_group = self.ulysses_group = self.ring_group = self.group
        self.ulysses_ranks = self.ring_ranks = self.ranks
        if self.world == 1:
            return  # every call is the engine's own: nothing to exchange
        _refuse_bound_split(dist, self)
        u = self.ulysses
        values = (self.ranks, u, self.ring, float(self.timeout), made_with)
        self.channel = _take_channel(dist, values, self)

        def make(purpose: str, ranks: tuple):
            return _group(dist, ranks, purpose, values, self.channel, made_with, self.wait_for)
        self.comm_group = make("all", self.ranks)
        self.ulysses_group, self.ring_group = self.comm_group, self.comm_group
        if u > 1 and self.ring > 1:
            # This rank's Ulysses group, then its ring: every member makes the groups it belongs to in
            # this order, so no member waits in one group's making for a peer that waits in another's.
            g, p = self.rank // u, self.rank % u
            self.ulysses_ranks = self.ranks[g * u:(g + 1) * u]
            self.ulysses_group = make(f"ulysses {g}", self.ulysses_ranks)
            self.ring_ranks = self.ranks[p::u]
            self.ring_group = make(f"ring {p}", self.ring_ranks)

    @property
    def mode(self) -> str:
        if self.ulysses > 1 and self.ring > 1:
            return "ulysses-ring"
        return "ring" if self.ring > 1 else "ulysses"

    @property
    def wait_for(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    def backend_for(self, device) -> str:
        """The backend torch runs this configuration's operations on for tensors on ``device``, read as
        torch reads it: the group's backend for that device type."""
        kind = device.type if hasattr(device, "type") else str(device)
        found = self.backends.get(kind) or self.backends.get("*")
        if found is None:
            raise ParallelError(f"rank {self.rank} of {self.world}: the group's backends ({self.backend}) take no "
                                f"{kind} tensors; initialise torch.distributed with a backend for {kind} (e.g. "
                                f"'cpu:gloo,cuda:nccl')")
        return found

    def in_use(self) -> "_Held":
        """Hold this configuration's channel for one call (``with par.in_use():``). A second thread that
        calls through it meanwhile is refused at once: its collectives would pair with the first
        thread's on the peers."""
        return self._held

    def describe(self) -> str:
        return f"{self.mode} over {self.world} ranks (ulysses {self.ulysses} x ring {self.ring}, {self.backend})"


class _Held:
    """The channel of one configuration held by the thread calling through it."""

    __slots__ = ("par", "lock", "user")

    def __init__(self, par: Parallel):
        # A weak reference: a strong one would put every configuration in a reference cycle, freed when
        # the cycle collector runs, at another time on each rank (and channels follow what is freed).
        self.par, self.lock, self.user = weakref.ref(par), threading.Lock(), None

    def __enter__(self):
        par = self.par()
        if not self.lock.acquire(blocking=False):
            raise ParallelError(
                f"rank {par.rank} of {par.world}: {par.describe()} (channel {par.channel}) is in use by "
                f"{self.user.name} while {threading.current_thread().name} calls through it; make one configuration "
                f"per thread (each has its own channel), on every rank in the same order")
        self.user = threading.current_thread()
        return par

    def __exit__(self, *exc):
        self.lock.release()


def device_backends(config: str) -> dict:
    """{device type: backend} from torch's backend configuration text (``get_backend_config``:
    ``"cpu:gloo,cuda:nccl"``; a bare name serves every device)."""
    found = {}
    for part in str(config).lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        if backend:
            found[device or "*"] = backend
    return found


def describe_backends(backends: dict) -> str:
    names = set(backends.values())
    if len(names) == 1:
        return names.pop()
    return ", ".join(f"{device}: {backend}" for device, backend in sorted(backends.items()))


def _c10d():
    from torch.distributed import distributed_c10d

    return distributed_c10d


def _refuse_bound_split(dist, par: Parallel) -> None:
    """With ``init_process_group(device_id=...)`` torch makes every NCCL group by splitting the default
    group's communicator, a step every process of the job must take; a configuration over part of the
    job is made by its members alone, so its first group would wait without end. Say so instead."""
    bound = getattr(_c10d()._get_default_group(), "bound_device_id", None)
    if bound is None or "nccl" not in par.backends.values() or len(par.ranks) == dist.get_world_size():
        return
    raise ParallelError(
        f"rank {dist.get_rank()}: torch.distributed was initialised with device_id={bound}, so torch makes every "
        f"NCCL group by splitting the default group's communicator, which every process of the job must join, "
        f"while a configuration over ranks {list(par.ranks)} is made by those ranks alone. Initialise without "
        f"device_id= (call torch.cuda.set_device(local_rank) before init_process_group), or make the "
        f"configuration over every rank of the job")


#: Channel numbers held by live configurations, by (default group, ranks and values).
_held: dict = {}
_held_lock = threading.Lock()


def _take_channel(dist, values: tuple, par: Parallel) -> int:
    key = (id(dist.group.WORLD), values)
    if _held.get(key):
        # Configurations held only by reference cycles go now, at this point of the program on every
        # rank, not whenever each rank's cycle collector happens to run: the ranks free the same ones and
        # so agree on the channel.
        gc.collect()
    with _held_lock:
        held = _held.setdefault(key, set())
        channel = next(n for n in range(len(held) + 1) if n not in held)
        held.add(channel)
    weakref.finalize(par, _give_back, key, channel)
    return channel


def _give_back(key, channel: int) -> None:
    with _held_lock:
        _held.get(key, set()).discard(channel)


#: Groups made for configurations, by (default group, name): reused by the next configuration on the
#: same channel; dropped once torch has destroyed them.
_groups: dict = {}
#: How many times each group was made under one default group: one made again after torch destroyed
#: it takes a new name (the store still holds the keys of the one before).
_made: dict = {}
_naming = threading.local()


def group_name(purpose: str, ranks: tuple, values: tuple, channel: int, made: int = 0) -> str:
    """The name of a configuration's group: from its ranks, what it is for, the configuration's values
    and its channel, nothing a process made before."""
    text = repr((purpose, tuple(ranks), values, channel, made))
    return "lib_attn:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:24]


def _group(dist, ranks: tuple, purpose: str, values: tuple, channel: int, backend: str, timeout):
    c10d = _c10d()
    world = dist.group.WORLD
    alive = set(c10d._world.pg_map)
    for old in [old for old, made in _groups.items() if made not in alive or old[0] is not world]:
        del _groups[old]  # destroyed by torch.distributed.destroy_process_group
    key = (id(world), group_name(purpose, ranks, values, channel))
    times = _made.get(key, 0)
    last = (world, group_name(purpose, ranks, values, channel, times - 1))
    if times and last in _groups:
        return _groups[last]
    name = group_name(purpose, ranks, values, channel, times)
    _made[key] = times + 1
    extra = {"group_desc": f"lib_attn {purpose} {values[1]}x{values[2]} channel {channel}"} \
        if _takes(dist.new_group, "group_desc") else {}
    _install_naming(c10d)
    _naming.name = name
    try:
        pg = dist.new_group(list(ranks), timeout=timeout, backend=backend, use_local_synchronization=True, **extra)
    finally:
        _naming.name = None
    _groups[world, name] = pg
    return pg


def _takes(fn, argument: str) -> bool:
    import inspect

    try:
        return argument in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _install_naming(c10d) -> None:
    """torch names a group made with local synchronisation from its ranks and how many groups the
    process holds (torch 2.13), or from its ranks and the names taken (2.1): members that made
    different groups before would name one group apart and wait on different store keys. While this
    module makes a group (on this thread), the name it chose is the one torch takes."""
    real = c10d._process_group_name
    if getattr(real, "_lib_attn", False):
        return

    def process_group_name(ranks, use_hashed_name):
        wanted = getattr(_naming, "name", None)
        if wanted and use_hashed_name:
            return wanted
        return real(ranks, use_hashed_name)
    process_group_name._lib_attn = True
    c10d._process_group_name = process_group_name


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
