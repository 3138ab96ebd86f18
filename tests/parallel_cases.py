"""One rank of the multi-process checks of ``lib_attn.parallel`` (started by tests/test_parallel.py
through ``lib_attn.parallel.launch.run_ranks``): runs every case on its share and reports its errors
against a float64 reference computed here from the whole inputs (the same on every rank: one seed).

    python tests/parallel_cases.py cases SEED      # every mode x kind x length x heads x dtype
    python tests/parallel_cases.py fault SEED HOW  # rank 1 raises before the call (raise), inside a ring
                                                   # step (step), or sleeps past the timeout (stall)
    python tests/parallel_cases.py nccl SEED HOW   # on GPUs: large ring blocks (cases), a stall (stall)
    python tests/parallel_cases.py sparse SEED     # sparse attention on: Ulysses runs it, ring steps dense
    python tests/parallel_cases.py jobs SEED       # 8 ranks as two jobs of 4, each its own 2x2 configuration
    python tests/parallel_cases.py threads SEED 2x1,2x1   # two configurations used at once from two threads
    python tests/parallel_cases.py backend SEED none      # init_process_group() without a backend (or 'cpu:gloo')
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lib_attn  # noqa: E402
from lib_attn import parallel  # noqa: E402
from lib_attn.parallel import launch, local, modes  # noqa: E402

D = 8
TEXT = 5


def reference(q, k, v):
    """softmax(q k^T / sqrt(d)) v in float64, written out: no engine code."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, dim=-1) @ v


def rel(a, b) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


def one_case(par, kind, n, heads, dtype, gen, layout="bhsd"):
    """(relative error of this rank's output, calls counted) for one call."""
    w, r = par.world, par.rank
    full = [torch.randn(2, heads, n, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    text = [torch.randn(2, heads, TEXT, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    start, stop = parallel.bounds(n, w, r)
    kwargs = {}
    if kind == "cross":
        q, k, v = full[0][:, :, start:stop], text[1], text[2]
        want = reference(full[0], text[1], text[2])[:, :, start:stop]
    elif kind == "self":
        q, k, v = (x[:, :, start:stop] for x in full)
        want = reference(*full)[:, :, start:stop]
    else:  # joint, text in front ("joint") or at the back ("joint-back")
        front = kind == "joint"
        whole = [torch.cat([t, x] if front else [x, t], dim=2) for t, x in zip(text, full)]
        ref = reference(*whole)
        ref_t, ref_x = (ref[:, :, :TEXT], ref[:, :, TEXT:]) if front else (ref[:, :, n:], ref[:, :, :n])
        q, k, v = (torch.cat([t, x[:, :, start:stop]] if front else [x[:, :, start:stop], t], dim=2)
                   for t, x in zip(text, full))
        want = torch.cat([ref_t, ref_x[:, :, start:stop]] if front else [ref_x[:, :, start:stop], ref_t], dim=2)
        kwargs = {"text_len": TEXT, "text_first": front}
        kind = "joint"
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    with lib_attn.recording() as rec:
        out = parallel.attention(q, k, v, kind=kind, layout=layout, role="dit", parallel=par, **kwargs)
    if layout == "bshd":
        out = out.transpose(1, 2)
    if out.shape != want.shape:
        return float("inf"), 0, {}
    if want.numel() == 0:
        return 0.0, sum(c for c, _ in rec.parallel.values()), rec.parallel
    return rel(out, want), sum(c for c, _ in rec.parallel.values()), rec.parallel


def cases(seed: int):
    began = time.monotonic()
    rank, world, _ = launch.init(timeout=60)
    gen = torch.Generator().manual_seed(seed)
    grids = [(u, world // u) for u in range(1, world + 1) if world % u == 0 and u in (1, 2, world)]
    results = []
    for u, r in grids:
        for uneven in ("pad", "ring") if u > 1 else ("pad",):
            par = parallel.Parallel(ulysses=u, ring=r, timeout=30, uneven_heads=uneven)
            for dtype in (torch.float32, torch.float64):
                for kind in ("self", "cross", "joint", "joint-back"):
                    for n in (8 * world, 5 * world + world - 1) + ((world - 1,) if kind == "self" else ()):
                        for heads in (4, 3) if uneven == "pad" else (3,):
                            err, counted, table = one_case(par, kind, n, heads, dtype, gen)
                            modes_seen = sorted({key[2] for key in table})
                            results.append({"grid": f"{u}x{r}", "uneven_heads": uneven, "dtype": str(dtype),
                                            "kind": kind, "n": n, "heads": heads, "err": err, "counted": counted,
                                            "modes": modes_seen,
                                            "bytes": sum(b for _, b in table.values())})
    par = parallel.Parallel(ring=world, timeout=30)
    err, counted, table = one_case(par, "joint", 4 * world + 1, 4, torch.float32, gen, layout="bshd")
    results.append({"grid": f"1x{world}", "kind": "joint bshd", "dtype": "torch.float32", "err": err,
                    "counted": counted, "uneven_heads": "pad", "n": 4 * world + 1, "heads": 4,
                    "modes": sorted({key[2] for key in table}), "bytes": sum(b for _, b in table.values())})
    extra = {"results": results, "rank": rank, "world": world,
             "zero_lse": _zero_lse_case(par, gen), "broken_merge": _broken_merge_case(par, gen)}
    extra["grouped"] = _grouped_case(gen)
    extra["transient"] = _transient_case(gen)
    extra["text_identical"] = _text_identical_case(gen)
    extra["mismatch"] = _mismatch_case(par, gen, seed)
    extra["groups"] = _groups_case(seed) if world == 4 else {}
    with lib_attn.recording() as rec:
        one_case(parallel.Parallel(timeout=30), "self", 4 * world, 4, torch.float32, gen)
    extra["report"] = lib_attn.Report.from_recording(rec).to_dict()
    extra["seconds"] = time.monotonic() - began
    launch.report(extra)
    launch.finish()


def _zero_lse_case(par, gen) -> dict:
    """A backend whose LSE form returns zeros must be caught by the LSE check, and the ring step
    recomputed: the result stays right and the guard counts the catch."""
    real = local.RUNNERS["sdpa"]

    def zero_lse(q, k, v, scale):
        out, lse = real(q, k, v, scale)
        return out, torch.zeros_like(lse)
    local.RUNNERS["sdpa"] = zero_lse
    local.reset()
    try:
        with lib_attn.recording() as rec:
            err, _, _ = one_case(par, "self", 6 * par.world + 1, 4, torch.float64, gen)
    finally:
        local.RUNNERS["sdpa"] = real
        local.reset()
    return {"err": err, "guard": [list(key) for key in rec.guard], "calls": [list(key) for key in rec.calls]}


def _grouped_case(gen) -> dict:
    """Every send and receive of a ring step must be issued inside ``batch_isend_irecv`` (NCCL needs
    them grouped): torch.distributed's point-to-point functions are wrapped here to count the calls
    made outside a batch, for every grid with a ring."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    seen = {"batches": 0, "grouped": 0, "ungrouped": 0}
    inside = []
    real = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}

    def counted(name):
        def call(*args, **kwargs):
            if name == "batch_isend_irecv":
                seen["batches"] += 1
                inside.append(1)
                try:
                    return real[name](*args, **kwargs)
                finally:
                    inside.pop()
            seen["grouped" if inside else "ungrouped"] += 1
            return real[name](*args, **kwargs)
        return call

    for name in real:  # the module's names (batch_isend_irecv checks its ops against them) and the package's
        setattr(c10d, name, counted(name))
        setattr(dist, name, getattr(c10d, name))
    errors = []
    try:
        w = dist.get_world_size()
        for u in [u for u in range(1, w) if w % u == 0]:  # every grid with a ring: 1 x w, and u x w/u
            par = parallel.Parallel(ulysses=u, ring=w // u, timeout=30)
            for kind in ("self", "joint"):
                errors.append(one_case(par, kind, 6 * w + 1, 4, torch.float64, gen)[0])
    finally:
        for name, fn in real.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
    return {**seen, "err": max(errors)}


def _transient_case(gen) -> dict:
    """One out-of-memory on rank 1 in its first ring step: that step is recomputed on the next backend,
    the kernel sits out a bounded number of ring steps (each counted as a fallback), then rank 1 is
    back on it; rank 0 never leaves it."""
    par = parallel.Parallel(ring=torch.distributed.get_world_size(), timeout=30)
    real = local.RUNNERS["sdpa"]
    failures = []

    def fails_once(q, k, v, scale):
        if par.rank == 1 and not failures:
            failures.append(1)
            raise RuntimeError("CUDA out of memory. Tried to allocate 738.00 MiB (injected)")
        return real(q, k, v, scale)
    local.RUNNERS["sdpa"] = fails_once
    local.reset()
    n = 8 * par.world  # even blocks: every ring step of every call has one signature
    phases = []
    try:
        # The first call fails once; the next RETRY_AFTER / world calls cover the steps sat out.
        for calls in (1, local.RETRY_AFTER // par.world, 3):
            with lib_attn.recording() as rec:
                errs = [one_case(par, "self", n, 4, torch.float32, gen)[0] for _ in range(calls)]
            phases.append({"err": max(errs), "calls": {"/".join(key[:2]): c for key, c in rec.calls.items()},
                           "fallbacks": {"/".join(key[1:]): c for key, c in rec.fallbacks.items()}})
    finally:
        local.RUNNERS["sdpa"] = real
        local.reset()
    return {"phases": phases, "failures": len(failures), "world": par.world}


def _text_identical_case(gen) -> list:
    """In every grid with a ring, the text part of a joint call's output must be the same bytes on every
    rank (Flux carries it on from block to block): each rank's text output is all-gathered here and
    compared bit for bit, in float32 and bfloat16."""
    import torch.distributed as dist

    w = dist.get_world_size()
    rows = []
    for u in [u for u in range(1, w) if w % u == 0]:
        par = parallel.Parallel(ulysses=u, ring=w // u, timeout=30)
        for dtype in (torch.float32, torch.bfloat16):
            for text in (w - 1, 2 * w + 1):  # fewer text rows than ranks, and more, split unevenly
                n = 6 * w + 1
                full = [torch.randn(2, 4, text + n, D, generator=gen, dtype=torch.float64) for _ in range(3)]
                start, stop = parallel.bounds(n, w, par.rank)
                q, k, v = (torch.cat([x[:, :, :text], x[:, :, text + start:text + stop]], dim=2).to(dtype)
                           for x in full)
                out = parallel.attention(q, k, v, kind="joint", text_len=text, parallel=par)
                mine = out[:, :, :text].contiguous()
                every = [torch.empty_like(mine) for _ in range(w)]
                # gloo in torch 2.1 takes no bfloat16: the same bytes, as float16 (gloo only moves them)
                raw = [x.view(torch.float16) if dtype == torch.bfloat16 else x for x in every]
                dist.all_gather(raw, mine.view(torch.float16) if dtype == torch.bfloat16 else mine)
                want = reference(*full)[:, :, :text]
                rows.append({"grid": f"{u}x{w // u}", "dtype": str(dtype), "text": text,
                             "identical": all(torch.equal(e, every[0]) for e in every),
                             "err": rel(mine, want)})
    return rows


def _groups_case(seed: int) -> dict:
    """Groups per channel, made by their members alone under names from their ranks and configuration:
    two live 2x2 configurations have their own groups; one made after both are gone reuses the first
    one's; pairs whose members made different numbers of groups before each make their own
    configuration, and both members name its group alike; a group torch destroyed is made anew."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    gen = torch.Generator().manual_seed(seed)
    rank = dist.get_rank()
    first = parallel.Parallel(ulysses=2, ring=2, timeout=30)
    second = parallel.Parallel(ulysses=2, ring=2, timeout=30)
    out = {"channels": [first.channel, second.channel],
           "own_groups": not ({id(g) for g in (first.comm_group, first.ulysses_group, first.ring_group)} &
                              {id(g) for g in (second.comm_group, second.ulysses_group, second.ring_group)})}
    groups = (first.comm_group, first.ulysses_group, first.ring_group)
    err = one_case(second, "self", 16, 4, torch.float64, gen)[0]
    del first, second
    third = parallel.Parallel(ulysses=2, ring=2, timeout=30)
    out["reused"] = third.channel == 0 and (third.comm_group, third.ulysses_group, third.ring_group) == groups
    err = max(err, one_case(third, "joint", 16, 4, torch.float64, gen)[0])
    # A configuration held only by a reference cycle, which one rank's collector frees before the others':
    # the next configuration still takes the same channel on every rank.
    import gc

    gc.disable()
    try:
        cycle = {"par": parallel.Parallel(ulysses=2, ring=2, timeout=30)}
        cycle["self"] = cycle
        del cycle
        if rank == 0:
            gc.collect()
        late = parallel.Parallel(ulysses=2, ring=2, timeout=30)
        out["cycle_channel"] = late.channel
        err = max(err, one_case(late, "self", 10, 4, torch.float64, gen)[0])
        del late
    finally:
        gc.enable()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # torch's rule: every process makes both
    pair = pairs[rank // 2]
    for _ in range(rank):  # rank r makes r groups of its own first: the members of a pair differ
        dist.new_group([rank], use_local_synchronization=True)
    made = {}
    for u, r in ((2, 1), (1, 2)):
        cfg = parallel.Parallel(ulysses=u, ring=r, group=pair, timeout=30)
        err = max(err, one_case(cfg, "joint", 9, 4, torch.float64, gen)[0])
        made[f"{u}x{r}"] = c10d._world.pg_names[cfg.comm_group]
    del cfg
    out["pair_names"] = made
    out["pair_ranks"] = list(pair_ranks(pair))
    # A group torch destroyed is dropped and made anew under a new name; the configuration works.
    par = parallel.Parallel(ring=2, group=pair, timeout=30)
    before = c10d._world.pg_names[par.comm_group]
    # Destroyed once both members have used it, as a program does: a member that destroys a group it has
    # just made, while its peer still connects to it, resets that connection (gloo on torch 2.1), and the
    # peer fails to make the group after it while this member waits in its making.
    dist.barrier(group=par.comm_group)
    dist.destroy_process_group(par.comm_group)
    del par
    again = parallel.Parallel(ring=2, group=pair, timeout=30)
    from lib_attn.parallel import mesh

    out["remade"] = {"before": before, "after": c10d._world.pg_names[again.comm_group],
                     "dropped": all(g in c10d._world.pg_map for g in mesh._groups.values())}
    err = max(err, one_case(again, "self", 7, 4, torch.float64, gen)[0])
    out["err"] = err
    return out


def pair_ranks(group):
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _mismatch_case(par, gen, seed: int) -> dict:
    """Rank 1 makes a call with other heads than the others: every rank must raise the same error at
    once (from the shape exchange), and the group stays usable."""
    start = time.monotonic()
    try:
        one_case(par, "self", 8 * par.world, 2 if par.rank == 1 else 4, torch.float32, gen)
        error = ""
    except parallel.ParallelError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    # Rank 1 drew fewer random numbers: a generator seeded alike on every rank for the call after.
    err, _, _ = one_case(par, "self", 8 * par.world, 4, torch.float64, torch.Generator().manual_seed(seed + 1))
    return {"error": error, "seconds": seconds, "err_after": err}


def _broken_merge_case(par, gen) -> float:
    """The checks must be able to fail: with the merge keeping only the last partial output, the
    error must be far above any bound."""
    real = modes._merge
    modes._merge = lambda acc, part: (part[0].to(part[1].dtype), part[1])
    try:
        err, _, _ = one_case(par, "self", 8 * par.world, 4, torch.float64, gen)
    finally:
        modes._merge = real
    return err


def jobs(seed: int):
    """8 ranks as two jobs of 4, as one world: each job's processes make only their own
    ``Parallel(ulysses=2, ring=2, group=...)``; the second job made other configurations and groups
    before (its processes have made more groups than the first job's). Every rank's share against
    float64."""
    import torch.distributed as dist

    rank, world, _ = launch.init(timeout=240)  # 8 processes starting on a few cores: joining may take long
    quads = [dist.new_group(list(range(j * 4, j * 4 + 4))) for j in range(world // 4)]  # torch's rule: all make all
    mine = quads[rank // 4]
    gen = torch.Generator().manual_seed(seed)
    out = {"rank": rank, "rows": []}
    began = time.monotonic()
    if rank >= 4:
        for _ in range(rank - 3):
            dist.new_group([rank], use_local_synchronization=True)
        out["rows"].append({"grid": "1x4", "err": one_case(parallel.Parallel(ring=4, group=mine, timeout=30),
                                                           "self", 11, 2, torch.float64, gen)[0]})
    par = parallel.Parallel(ulysses=2, ring=2, group=mine, timeout=30)
    for kind, n in (("self", 16), ("joint", 13)):
        out["rows"].append({"grid": "2x2", "kind": kind, "err": one_case(par, kind, n, 4, torch.float64, gen)[0]})
    out["seconds"] = time.monotonic() - began
    out["job_ranks"] = list(par.ranks)
    launch.report(out)
    launch.finish()


def threads(seed: int, grids: str):
    """Two configurations over the same 2 ranks, made in this order on every rank, each used from its
    own thread for 20 calls at once: every call against float64. Then one configuration held by one
    thread and called from another: refused at once."""
    import threading

    rank, world, _ = launch.init(timeout=60)
    shapes = [tuple(int(x) for x in grid.split("x")) for grid in grids.split(",")]
    pars = [parallel.Parallel(ulysses=u, ring=r, timeout=20) for u, r in shapes]
    start = threading.Barrier(len(pars))
    rows = [None] * len(pars)

    def work(i):
        gen = torch.Generator().manual_seed(seed + i)  # each thread its own stream, alike on every rank
        began = time.monotonic()
        try:
            start.wait()
            errs = [one_case(pars[i], ("self", "joint")[c % 2], 9 + c % 3, 4, torch.float64, gen)[0]
                    for c in range(20)]
            rows[i] = {"grid": grids.split(",")[i], "err": max(errs), "calls": len(errs), "error": ""}
        except Exception as exc:  # noqa: BLE001 - the test reads what each thread saw
            rows[i] = {"grid": grids.split(",")[i], "error": f"{type(exc).__name__}: {exc}"}
        rows[i]["seconds"] = time.monotonic() - began
    workers = [threading.Thread(target=work, args=(i,), name=f"pipeline-{i}") for i in range(len(pars))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out = {"rank": rank, "rows": rows, "channels": [p.channel for p in pars]}
    held, refused = threading.Event(), {}

    def holder():
        with pars[0].in_use():
            held.set()
            time.sleep(1)
    keeper = threading.Thread(target=holder, name="pipeline-0")
    keeper.start()
    held.wait()
    began = time.monotonic()
    try:
        q = torch.randn(1, 4, 5, D, dtype=torch.float64)
        parallel.attention(q, q, q, parallel=pars[0])
        refused["error"] = ""
    except parallel.ParallelError as exc:
        refused["error"] = str(exc)
    refused["seconds"] = time.monotonic() - began
    keeper.join()
    out["refused"] = refused
    launch.report(out)
    launch.finish()


def backend(seed: int, name: str):
    """torch.distributed initialised as torch decides the backend: without one (torch says 'undefined')
    or as 'cpu:gloo'; the configuration reads gloo for CPU tensors and its calls work."""
    import datetime

    import torch.distributed as dist

    if name == "none":
        try:
            dist.init_process_group(timeout=datetime.timedelta(seconds=60))
        except RuntimeError as exc:  # torch 2.1's CUDA build makes a NCCL backend too, which needs a GPU
            launch.report({"init_error": str(exc)})
            os._exit(0)
    else:
        dist.init_process_group(name, timeout=datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(seed)
    out = {"rank": dist.get_rank(), "torch_says": str(dist.get_backend()), "rows": []}
    for u, r in ((2, 1), (1, 2)):
        par = parallel.Parallel(ulysses=u, ring=r, timeout=20)
        out["describe"] = par.describe()
        out["cpu"] = par.backend_for(torch.device("cpu"))
        for dtype in (torch.float64, torch.bfloat16):
            err = one_case(par, "joint", 9, 4, dtype, gen)[0]
            out["rows"].append({"grid": f"{u}x{r}", "dtype": str(dtype), "err": err})
    launch.report(out)
    launch.finish()


def fault(seed: int, how: str):
    rank, world, _ = launch.init(timeout=30)
    par = parallel.Parallel(ring=world, timeout=float(os.environ.get("PARALLEL_TIMEOUT", "3")))
    gen = torch.Generator().manual_seed(seed)
    start = time.monotonic()
    error = ""
    try:
        if rank == 1 and how == "raise":
            raise RuntimeError("injected failure on rank 1")
        if rank == 1 and how == "step":
            def failing(*args):
                raise RuntimeError("injected failure inside a ring step on rank 1")
            modes.attention_lse = failing
        if rank == 1 and how == "stall":
            time.sleep(float(os.environ.get("PARALLEL_STALL", "8")))
        for _ in range(3):  # a generation goes on calling: a rank that was served before the fault is not spared
            one_case(par, "self", 8 * world, 4, torch.float32, gen)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        error = f"{type(exc).__name__}: {exc}"
    launch.report({"rank": rank, "error": error, "seconds": time.monotonic() - start})
    os._exit(1 if error else 0)  # leave at once: a broken group must not hold the process at exit


#: How long rank 1 stalls in the NCCL stall case: far past the 5-second timeout and the test's margin.
STALL_SECONDS = 60


def nccl(seed: int, how: str):
    """On GPUs over NCCL (tests/gpu/test_gpu_parallel.py): ``cases``: ring and Ulysses calls whose ring
    blocks (128 MiB of keys and values) are far beyond NCCL's buffers, each rank's rows checked
    against float64 on sampled query rows; ``stall``: after a warm-up call, rank 1 stalls inside a ring step
    past the 5-second timeout."""
    from lib_attn import check

    rank, world, backend = launch.init(timeout=120)
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {"rank": rank, "backend": backend, "rows": []}
    if how == "stall":
        par = parallel.Parallel(ring=world, timeout=5)
        q = torch.randn(1, 8, 4096, 128, device=device, dtype=torch.bfloat16, generator=gen)
        whole = 4096 * world  # given: no exchange of lengths, a call's first operation is its ring step
        # A warm-up call first: NCCL makes a group's communicator at its first operation, and a rank
        # waiting there is bounded by no timeout of the group (docs/parallel.md).
        parallel.attention(q, q, q, kind="self", seq_len=whole, parallel=par)
        torch.cuda.synchronize()
        if rank == 1:  # stall inside a ring step, after its send and receive were issued
            real, stalled = modes.attention_lse, []

            def stall(*args):
                if not stalled:
                    stalled.append(1)
                    time.sleep(STALL_SECONDS)
                return real(*args)
            modes.attention_lse = stall
        start = time.monotonic()
        try:
            for _ in range(3):  # rank 0's second call waits on rank 1's ring step
                parallel.attention(q, q, q, kind="self", seq_len=whole, parallel=par)
                torch.cuda.synchronize()
            out["error"] = ""
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - start
        launch.report(out)
        os._exit(1 if out["error"] else 0)
    n, heads, text = 65536, 8, 512
    bound = check.bound(torch.bfloat16, "cuda", False)
    for u, r in ((world, 1), (1, world)):
        par = parallel.Parallel(ulysses=u, ring=r, timeout=120)
        for kind in ("self", "joint"):
            t = text if kind == "joint" else 0
            full = [torch.randn(1, heads, t + n, 128, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(3)]
            start, stop = parallel.bounds(n, world, rank)
            q, k, v = (torch.cat([x[:, :, :t], x[:, :, t + start:t + stop]], dim=2) for x in full)
            with lib_attn.recording() as rec:
                got = parallel.attention(q, k, v, kind=kind, text_len=t, parallel=par)
            torch.cuda.synchronize()
            # float64 on 64 sampled rows of this rank's output against every key.
            rows = torch.linspace(0, q.shape[2] - 1, 64, device=device).round().long()
            scores = (q[:, :, rows].double() @ full[1].double().transpose(-1, -2)) / 128 ** 0.5
            want = torch.softmax(scores, dim=-1) @ full[2].double()
            out["rows"].append({"grid": f"{u}x{r}", "kind": kind, "err": rel(got[:, :, rows], want), "bound": bound,
                                "calls": {"/".join(key[:2]): c for key, c in rec.calls.items()},
                                "sent": sum(b for _, b in rec.parallel.values())})
    launch.report(out)
    launch.finish()


def nccl_layouts(seed: int, how: str):
    """On GPUs (tests/gpu/test_gpu_parallel.py): ``undefined``: init_process_group() without a backend,
    CUDA tensors on NCCL; ``threads``: two configurations over the same ranks used at once from two
    threads; ``bound``: init_process_group("nccl", device_id=...) with a configuration over every rank
    (works) and, with 4 or more ranks, one over a pair (refused at once); ``pairs``: with 4 or more
    ranks, pairs whose members made different numbers of groups before, each its own configuration."""
    import datetime
    import threading

    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    wait = datetime.timedelta(seconds=120)
    if how == "undefined":
        dist.init_process_group(timeout=wait)
    elif how == "bound":
        import inspect

        if "device_id" not in inspect.signature(dist.init_process_group).parameters:
            launch.report({"skip": f"torch {torch.__version__} binds no device in init_process_group"})
            os._exit(0)
        dist.init_process_group("nccl", timeout=wait, device_id=device)
    else:
        dist.init_process_group("nccl", timeout=wait)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "torch_says": str(dist.get_backend()), "rows": [], "error": ""}

    def check(par, n, gen, label):
        full = [torch.randn(1, 8, n, 64, device=device, dtype=torch.float32, generator=gen) for _ in range(3)]
        start, stop = parallel.bounds(n, par.world, par.rank)
        got = parallel.attention(*(x[:, :, start:stop] for x in full), kind="self", parallel=par)
        want = reference(*full)[:, :, start:stop]
        out["rows"].append({"label": label, "err": rel(got, want), "backend": par.backend_for(device),
                            "describe": par.describe()})

    if how == "undefined":
        for u, r in ((world, 1), (1, world)):
            check(parallel.Parallel(ulysses=u, ring=r, timeout=60), 1024, torch.Generator(device).manual_seed(seed),
                  f"{u}x{r}")
    elif how == "threads":
        pars = [parallel.Parallel(ring=world, timeout=60), parallel.Parallel(ring=world, timeout=60),
                parallel.Parallel(ulysses=world, timeout=60)]
        errors = []

        def work(i):
            try:
                gen = torch.Generator(device).manual_seed(seed + i)
                for c in range(20):
                    check(pars[i], 512 + 64 * (c % 3), gen, f"thread {i}")
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - the test reads what each thread saw
                errors.append(f"{type(exc).__name__}: {exc}")
        workers = [threading.Thread(target=work, args=(i,)) for i in range(len(pars))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        out["error"] = "; ".join(errors)
    elif how == "bound":
        check(parallel.Parallel(ulysses=2, ring=world // 2, timeout=60), 1024,
              torch.Generator(device).manual_seed(seed), "every rank")
        if world >= 4:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # torch's rule: every process makes both
            if rank < 4:
                pair = pairs[rank // 2]
                try:
                    parallel.Parallel(ring=2, group=pair, timeout=60)
                except parallel.ParallelError as exc:
                    out["error"] = str(exc)
    elif how == "pairs" and world >= 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        if rank < 4:
            for _ in range(rank):
                dist.new_group([rank], use_local_synchronization=True)
            for u, r in ((2, 1), (1, 2)):
                check(parallel.Parallel(ulysses=u, ring=r, group=pairs[rank // 2], timeout=60), 1024,
                      torch.Generator(device).manual_seed(seed), f"{u}x{r}")
    torch.cuda.synchronize()
    launch.report(out)
    launch.finish()


def sparse(seed: int):
    """One self-attention call with local structure under Ulysses and under ring, sparse attention on:
    this rank's error against float64, and what the readout counted."""
    from lib_attn.commands.bench.inputs import local_inputs

    rank, world, _ = launch.init(timeout=60)
    lib_attn.configure(sparse="block-sparse, min_tokens=512, dense=none, budget=0.2")
    n, heads = 2048, 2 * world
    q, k, v = local_inputs(1, heads, (n,), 32, torch.float32, torch.device("cpu"), seed=seed, strength=1.0)
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 32 ** 0.5, dim=-1) @ v.double()
    start, stop = parallel.bounds(n, world, rank)
    out = {"rank": rank}
    for name, par in (("ulysses", parallel.Parallel(ulysses=world, timeout=60)),
                      ("ring", parallel.Parallel(ring=world, timeout=60))):
        with lib_attn.recording() as rec:
            got = parallel.attention(*(x[:, :, start:stop] for x in (q, k, v)), kind="self", role="dit", parallel=par)
        report = rec.sparse
        out[name] = {"err": rel(got, want[:, :, start:stop]), "calls": [list(key) for key in rec.calls],
                     "fallbacks": [list(key) for key in rec.fallbacks],
                     "sparse_calls": report.calls if report else 0,
                     "error_max": report.error_max() if report else None}
    launch.report(out)
    launch.finish()


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        cases(int(sys.argv[2]))
    elif sys.argv[1] == "nccl":
        nccl(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "sparse":
        sparse(int(sys.argv[2]))
    elif sys.argv[1] == "nccl-layouts":
        nccl_layouts(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "jobs":
        jobs(int(sys.argv[2]))
    elif sys.argv[1] == "threads":
        threads(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "backend":
        backend(int(sys.argv[2]), sys.argv[3])
    else:
        fault(int(sys.argv[2]), sys.argv[3])
