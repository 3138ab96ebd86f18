"""The collectives a parallel call makes, each bounded in time and counted in bytes.

Only what gloo has too: ``all_to_all_single`` with split sizes (gloo has no list ``all_to_all`` in
torch 2.1, and ``all_to_all_single`` takes uneven splits on both backends), ``all_gather``
of equal-sized tensors, and, for a ring step, one send and one receive issued together by
``batch_isend_irecv``. The same calls run on NCCL, where the grouping is what lets a ring step
complete: a send and a receive issued apart are two NCCL operations, and with each rank's send queued
ahead of its receive, a send larger than NCCL's buffers waits for a receive its peer has not posted
(with a ring of 2 the peer sent to is the peer received from). Grouped (``ncclGroupStart/End``), both
move at once.

Which backend moves a tensor is read as torch reads it: the group's backend for the tensor's device
(``init_process_group()`` without a backend, or ``"cpu:gloo,cuda:nccl"``, puts CUDA tensors on NCCL and
CPU ones on gloo). Every operation is started asynchronously and waited for with the configuration's
timeout on gloo, where ``Work.wait(timeout)`` raises when a peer failed or stalled. On NCCL every
operation runs in the configuration's own group, made with its timeout (``mesh``), and PyTorch's
watchdog ends it: with
``TORCH_NCCL_BLOCKING_WAIT=1`` the CPU waits for each operation and ``wait`` raises at the timeout;
otherwise (the default: a CPU wait would hold back the kernels queued behind the exchange) the
watchdog's asynchronous error handling ends the process. A failure that reaches Python becomes a
``ParallelError`` that names this rank, the operation and the peers, on every rank that waits, so a
rank that raised or stalled never leaves the others hanging without end.
"""
from __future__ import annotations

import os

import torch

from .mesh import Parallel, ParallelError


class Traffic:
    """Bytes this rank sent during one parallel call (what the readout reports per call)."""

    __slots__ = ("sent",)

    def __init__(self):
        self.sent = 0


#: PyTorch's switches that make an NCCL wait block the CPU and raise at the group's timeout.
BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def blocking_wait() -> bool:
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in BLOCKING_WAIT)


def _wait(work, par: Parallel, what: str, peers, device) -> None:
    try:
        if par.backend_for(device) != "nccl" or blocking_wait():
            work.wait(timeout=par.wait_for)
        else:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - every transport error becomes one clear error
        raise ParallelError(
            f"rank {par.rank} of {par.world} ({par.mode}): {what}{f' with ranks {list(peers)}' if peers else ''} "
            f"failed: a peer rank "
            f"raised, left, or stalled past the timeout of {par.timeout:g} s ({str(exc).strip()[:300]})"
        ) from exc


def _dist():
    import torch.distributed as dist

    return dist


def all_gather_ints(values: list[int], par: Parallel, group, ranks, device) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), in the group's rank order. ``device``: where the
    call's tensors are; the numbers travel on the CPU where the group has a CPU backend (no wait for the
    GPU's queue), else on that device."""
    dist = _dist()
    device = torch.device("cpu") if "cpu" in par.backends or "*" in par.backends else device
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in ranks]
    _wait(dist.all_gather(out, mine, group=group, async_op=True), par, "the shape exchange", ranks, device)
    return [t.tolist() for t in out]


def all_gather(t: torch.Tensor, par: Parallel, group, ranks, traffic: Traffic) -> list[torch.Tensor]:
    """Every rank's ``t`` (all of the same shape), in the group's rank order."""
    dist = _dist()
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in ranks]
    _wait(dist.all_gather([_wire(o, par) for o in out], _wire(t, par), group=group, async_op=True), par,
          "all_gather", ranks, t.device)
    traffic.sent += t.numel() * t.element_size() * (len(ranks) - 1)
    return out


def all_to_all(send: torch.Tensor, sizes_out: list[int], sizes_in: list[int], par: Parallel, group, ranks,
               traffic: Traffic, me: int) -> list[torch.Tensor]:
    """Send the j-th ``sizes_out[j]`` elements of the contiguous ``send`` to the j-th rank of ``group``
    and return what each rank sent here, as flat tensors of ``sizes_in[j]`` elements. One
    ``all_to_all_single`` over flat buffers: pieces may differ in size (uneven sequence shards)."""
    dist = _dist()
    send = send.reshape(-1)
    recv = torch.empty(sum(sizes_in), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(_wire(recv, par), _wire(send, par), sizes_in, sizes_out, group=group,
                                  async_op=True)
    _wait(work, par, "all_to_all", ranks, send.device)
    traffic.sent += (send.numel() - sizes_out[me]) * send.element_size()
    return list(recv.split(sizes_in))


def exchange(send: torch.Tensor, recv_numel: int, to_rank: int, from_rank: int, par: Parallel):
    """Start sending ``send`` to global rank ``to_rank`` and receiving ``recv_numel`` elements from
    ``from_rank`` (a ring step); returns a function that waits for both and gives the received buffer.
    Point-to-point goes through the configuration's group, which holds every rank of its subgroups
    (peers are named by their global rank)."""
    dist = _dist()
    send = send.contiguous()
    recv = torch.empty(recv_numel, dtype=send.dtype, device=send.device)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _wire(send.reshape(-1), par), to_rank, par.comm_group),
                                    dist.P2POp(dist.irecv, _wire(recv, par), from_rank, par.comm_group)])

    def done():
        for work in works:
            _wait(work, par, f"ring step (sending to rank {to_rank}, receiving from rank {from_rank})", (),
                  send.device)
        return recv
    return done


def _wire(t: torch.Tensor, par: Parallel) -> torch.Tensor:
    """``t`` as the transport takes it: bfloat16 travels as the same bytes labelled float16 on gloo, whose
    torch 2.1 build refuses bfloat16 (and int16) with "Invalid scalar type"; gloo only moves them."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 and par.backend_for(t.device) == "gloo" else t
