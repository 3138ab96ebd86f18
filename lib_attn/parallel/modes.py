"""The two ways a sequence split over ranks is attended to, and their combination.

Each rank enters with its text part (the same on every rank; empty for self-attention) and its shard
of the split part, q, k and v in (b, h, s, d), and leaves with the output of the same tokens.

* **Ulysses** (within a Ulysses group of U ranks): one all-to-all turns the sequence split into a head
  split, so each rank holds every token of the group's block for H/U heads; attention runs there; one
  all-to-all turns it back. The text part needs no exchange on the way in (every rank holds it: each
  takes its heads) and one all-gather of its heads on the way out.
* **Ring** (over a ring of R ranks, each holding one block): every rank attends its queries to its own
  keys and values, then to each other rank's as they come round the ring, and merges the partial
  outputs by their log-sum-exp in fp32 (fp64 for fp64 inputs). The text's keys and values are
  attended to once, in the first step; the text's queries are split over the ring's ranks and their
  outputs all-gathered. The next block is already on its way while a step computes.
* **Both**: Ulysses within each group, then a ring across the groups over the Ulysses outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dispatch as _dispatch
from . import comm, sharding
from .local import attention_lse


@dataclass
class Layout:
    """Where this rank stands for one call: its Ulysses group and ring (group, global ranks, own
    position in each) and every rank's split-part length, by position in the whole group."""

    u_group: object
    u_ranks: tuple
    u_me: int
    r_group: object
    r_ranks: tuple
    r_me: int
    lens: list

    @property
    def u(self) -> int:
        return len(self.u_ranks)

    @property
    def r(self) -> int:
        return len(self.r_ranks)

    def member_lens(self, block: int) -> list[int]:
        """Split-part lengths of the ranks of Ulysses group ``block``."""
        return self.lens[block * self.u:(block + 1) * self.u]


def run(par, lay: Layout, text: tuple, part: tuple, scale: float, role: str, traffic) -> tuple:
    """(text output, split-part output) of this rank: text (b, h, T, d) and part (b, h, s, d) each."""
    tq, tk, tv = text
    heads = part[0].shape[1]
    block = lay.r_me  # the Ulysses group this rank belongs to is its position on the ring
    if lay.u > 1:
        hp = heads // lay.u
        mine = slice(lay.u_me * hp, (lay.u_me + 1) * hp)
        tq, tk, tv = (t[:, mine] for t in (tq, tk, tv))
        bq, bk, bv = _to_heads(par, lay, part, hp, traffic)
    else:
        bq, bk, bv = part
    if lay.r > 1:
        out_t, out_b = _ring(par, lay, (tq, tk, tv), (bq, bk, bv), scale, role, traffic)
    else:
        out_t, out_b = _local(tq, tk, tv, bq, bk, bv, scale, role)
    if lay.u > 1:
        out_b = _to_sequence(par, lay, out_b, block, traffic)
        if out_t.shape[2]:
            out_t = torch.cat(comm.all_gather(out_t, par, lay.u_group, lay.u_ranks, traffic), dim=1)
        else:
            out_t = out_t.new_empty(out_t.shape[0], heads, 0, out_t.shape[3])
    return out_t, out_b


def _to_heads(par, lay: Layout, part: tuple, hp: int, traffic) -> tuple:
    """The all-to-all in: member j gets head group j of this rank's shard, q, k and v in one message;
    this rank gets its head group of every member's shard, joined along the sequence."""
    q, k, v = part
    b, _, s, d = q.shape
    # One send buffer, (member, q/k/v, b, hp, s, d), filled by one copy of each of q, k and v: the
    # message for member j is its contiguous slice j.
    send = q.new_empty((lay.u, 3, b, hp, s, d))
    for i, t in enumerate((q, k, v)):
        send[:, i].copy_(t.reshape(b, lay.u, hp, s, d).transpose(0, 1))
    lens = lay.member_lens(lay.r_me)
    got = comm.all_to_all(send, [3 * b * hp * s * d] * lay.u, [3 * b * hp * n * d for n in lens], par,
                          lay.u_group, lay.u_ranks, traffic, lay.u_me)
    del send  # before the join: the received pieces and the joined sequence are the peak
    joined = torch.cat([g.view(3, b, hp, n, d) for g, n in zip(got, lens)], dim=3)
    return joined[0], joined[1], joined[2]


def _to_sequence(par, lay: Layout, out: torch.Tensor, block: int, traffic) -> torch.Tensor:
    """The all-to-all out: member j gets this rank's heads of its own tokens; this rank gets every
    member's heads of its tokens, joined along the heads."""
    lens = lay.member_lens(block)
    b, hp, _, d = out.shape
    send = torch.cat([p.reshape(-1) for p in out.split(lens, dim=2)])
    n = lens[lay.u_me]
    got = comm.all_to_all(send, [b * hp * m * d for m in lens], [b * hp * n * d] * lay.u, par, lay.u_group,
                          lay.u_ranks, traffic, lay.u_me)
    del send
    return torch.cat([g.view(b, hp, n, d) for g in got], dim=1)


def _local(tq, tk, tv, bq, bk, bv, scale, role):
    """Attention over the whole sequence on this rank: the engine's call, as any other."""
    t = tq.shape[2]
    q = torch.cat([tq, bq], dim=2) if t else bq
    if q.shape[2] == 0:
        return tq, bq
    k = torch.cat([tk, bk], dim=2) if t else bk
    v = torch.cat([tv, bv], dim=2) if t else bv
    out = _dispatch.attention(q, k, v, scale=scale, role=role)
    return out[:, :, :t], out[:, :, t:]


def _ring(par, lay: Layout, text: tuple, block: tuple, scale, role, traffic) -> tuple:
    """The ring over ``lay``'s ring: this rank's queries (its block's, and its share of the text's)
    against every block's keys and values, merged by their log-sum-exp.

    The text's query rows are split over the ring's ranks like a sequence and their outputs all-gathered:
    each row is computed once, on one rank, so every rank ends with the same bytes (each merging every
    row in its own order would leave the ranks' text apart by rounding, and Flux carries the text on
    from block to block), and no rank computes the whole text again."""
    tq, tk, tv = text
    bq, bk, bv = block
    t = tq.shape[2]
    t_lens = sharding.sizes(t, lay.r)
    t_mine = t_lens[lay.r_me]
    if t:
        start = sum(t_lens[:lay.r_me])
        q = torch.cat([tq[:, :, start:start + t_mine], bq], dim=2)
    else:
        q = bq
    b, h, _, d = bk.shape
    block_lens = [sum(lay.member_lens(j)) for j in range(lay.r)]
    nxt, prev = lay.r_ranks[(lay.r_me + 1) % lay.r], lay.r_ranks[(lay.r_me - 1) % lay.r]
    kv = torch.stack([bk, bv])
    acc = None
    for step in range(lay.r):
        src = (lay.r_me - step) % lay.r  # whose block this rank holds now
        waiting = None
        if step < lay.r - 1:  # pass it on before computing on it, so the transfer overlaps the kernel
            incoming = block_lens[(src - 1) % lay.r]
            waiting = comm.exchange(kv, 2 * b * h * incoming * d, nxt, prev, par)
            traffic.sent += kv.numel() * kv.element_size()
        k, v = kv[0], kv[1]
        if step == 0 and t:
            k, v = torch.cat([tk, k], dim=2), torch.cat([tv, v], dim=2)
        if q.shape[2] and k.shape[2]:
            acc = _merge(acc, attention_lse(q, k, v, scale, role))
        if waiting is not None:
            kv = waiting().view(2, b, h, block_lens[(src - 1) % lay.r], d)
    if acc is None:
        out = q.new_zeros(q.shape)
    else:
        out = acc[0].to(q.dtype)
    if not t:
        return out[:, :, :0], out
    return _gather_text(par, lay, out[:, :, :t_mine], t_lens, traffic), out[:, :, t_mine:]


def _gather_text(par, lay: Layout, mine: torch.Tensor, t_lens: list, traffic) -> torch.Tensor:
    """Every ring rank's rows of the text output, joined in ring order (the same on every rank)."""
    most = max(t_lens)
    if mine.shape[2] < most:  # all_gather takes equal shapes: pad to the longest share, trim after
        mine = torch.cat([mine, mine.new_zeros(*mine.shape[:2], most - mine.shape[2], mine.shape[3])], dim=2)
    parts = comm.all_gather(mine, par, lay.r_group, lay.r_ranks, traffic)
    return torch.cat([p[:, :, :n] for p, n in zip(parts, t_lens)], dim=2)


def _merge(acc, part):
    """Two partial attentions over disjoint keys as one: weights exp(lse_i - lse) in fp32 or fp64. The
    accumulator (this function's own fp32/fp64 copy) is updated in place: no output-sized temporary."""
    out, lse = part
    if acc is None:
        return out.to(lse.dtype, copy=True), lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1)).addcmul_(out, torch.exp(lse - new).unsqueeze(-1))
    return acc_out, new
