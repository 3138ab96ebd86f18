"""The sharding convention: which rank holds which tokens of a sequence split over the ranks.

A sequence of ``n`` tokens split over ``w`` ranks gives rank ``r`` (its position in the group) the
contiguous tokens ``[start(r), start(r) + size(r))``, where the first ``n % w`` ranks hold
``n // w + 1`` tokens and the others ``n // w`` (``torch.tensor_split``'s rule). Nothing has to divide:
with fewer tokens than ranks, the last ranks hold none. A joint call's text part is not split: every
rank holds all of it, beside its share of the image/video tokens.
"""
from __future__ import annotations

import torch


def sizes(n: int, world: int) -> list[int]:
    """Tokens each rank holds of a sequence of ``n``, in rank order."""
    if n < 0 or world < 1:
        raise ValueError(f"cannot split {n} tokens over {world} ranks")
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, stop) of the tokens rank ``rank`` holds."""
    s = sizes(n, world)
    start = sum(s[:rank])
    return start, start + s[rank]


def shard(x: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (a view)."""
    start, stop = bounds(x.shape[dim], world, rank)
    return x.narrow(dim, start, stop - start)


def gather(x: torch.Tensor, dim: int, par, total: int | None = None) -> torch.Tensor:
    """Every rank's share of ``x`` along ``dim``, joined in rank order (on every rank). ``total``: the
    whole length when the caller knows it (else the ranks exchange their lengths first)."""
    if par is None or par.world == 1:
        return x
    with par.in_use():
        return _gather(x, dim, par, total)


def _gather(x: torch.Tensor, dim: int, par, total) -> torch.Tensor:
    from . import comm

    if total is None:
        lens = [row[0] for row in comm.all_gather_ints([x.shape[dim]], par, par.comm_group, par.ranks, x.device)]
    else:
        lens = sizes(total, par.world)
        if lens[par.rank] != x.shape[dim]:
            raise ValueError(f"rank {par.rank} holds {x.shape[dim]} tokens along dim {dim}, but a sequence of "
                             f"{total} split over {par.world} ranks gives it {lens[par.rank]}")
    most = max(lens)
    if most == 0:
        return x
    pad = most - x.shape[dim]
    if pad:  # all_gather takes equal shapes: pad to the longest share, trim after
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    parts = comm.all_gather(x, par, par.comm_group, par.ranks, comm.Traffic())
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim)
