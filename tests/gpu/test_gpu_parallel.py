"""Context parallelism over NCCL between two GPUs of one machine (skipped with fewer than two).

A ring step's send and receive must be grouped for NCCL to complete them when a block is larger than
its buffers: here a ring block is 128 MiB of keys and values (bf16, 8 heads of 128, 32,768 tokens),
run in ring and Ulysses modes, self and joint, each rank's rows checked against float64. A rank that
stalls inside a ring step (after a warm-up call made the group's communicator) past the configuration's
5-second timeout must end the waiting rank within a margin: with TORCH_NCCL_BLOCKING_WAIT=1 as a
ParallelError naming the ring step; without it, by PyTorch's watchdog, which ends the process with a
non-zero code (no Python error, but no rank left waiting). Job layouts on NCCL: init_process_group()
without a backend, three configurations used at once from three threads, a bound device (device_id=),
and, with four GPUs, pairs whose members made different numbers of groups before.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from lib_attn.parallel import launch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(HERE, "parallel_cases.py")

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                                reason="needs two CUDA devices and NCCL")


def _ranks(how: str, env: dict | None = None, timeout: float = 300):
    seed = random.SystemRandom().randrange(2**31)
    return launch.run_ranks(2, [CASES, "nccl", str(seed), how], timeout=timeout, env=env), seed


def test_ring_and_ulysses_over_nccl_with_blocks_beyond_its_buffers():
    ranks, seed = _ranks("cases")
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        res = r["result"]
        assert res["backend"] == "nccl"
        assert {(row["grid"], row["kind"]) for row in res["rows"]} == {("2x1", "self"), ("2x1", "joint"),
                                                                        ("1x2", "self"), ("1x2", "joint")}
        for row in res["rows"]:
            print(r["rank"], row)
            assert row["err"] <= row["bound"] and row["sent"] > 0, (seed, row)


#: What a stalled rank's peer may take past the 5-second timeout to end: NCCL's watchdog polls its
#: operations about once a second, then the process must stop.
MARGIN = 25


def test_a_stalled_rank_ends_every_rank_as_a_parallel_error_with_blocking_wait():
    # Rank 1 stalls 60 s inside a ring step of a group already warmed up; the launcher ends whatever runs
    # past the timeout and the margin, so rank 0 must have ended with its own error before.
    ranks, _ = _ranks("stall", env={"TORCH_NCCL_BLOCKING_WAIT": "1"}, timeout=5 + MARGIN)
    first = ranks[0]
    assert first["result"], first["output"]
    assert first["result"]["error"].startswith("ParallelError: rank 0 of 2 (ring): ring step"), first["result"]
    assert first["result"]["seconds"] < 5 + MARGIN and first["returncode"] == 1, first["result"]


def test_a_stalled_rank_ends_every_rank_through_the_watchdog_by_default():
    # Without blocking wait the watchdog ends the process whose ring step passed the group's timeout:
    # rank 0 exits with a non-zero code before the launcher's limit (None: it had to be ended).
    ranks, _ = _ranks("stall", env={"TORCH_NCCL_BLOCKING_WAIT": "0"}, timeout=5 + MARGIN)
    codes = [r["returncode"] for r in ranks]
    print(codes, [(r["result"] or {}).get("error", "")[:200] for r in ranks])
    assert ranks[0]["returncode"] not in (None, 0), [r["output"][-800:] for r in ranks]


def _layouts(how: str, ranks: int = 2):
    seed = random.SystemRandom().randrange(2**31)
    return launch.run_ranks(ranks, [CASES, "nccl-layouts", str(seed), how], timeout=240), seed


@pytest.mark.parametrize("how", ["undefined", "threads", "bound"])
def test_nccl_backend_read_for_cuda_tensors_two_threads_and_a_bound_device(how):
    # init_process_group() without a backend: CUDA tensors go on NCCL (the configuration's own group,
    # with its timeout). Three configurations over the same 2 ranks used at once from three threads:
    # each its own channel. With a bound device (device_id=), a configuration over every rank works.
    ranks, seed = _layouts(how)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        res = r["result"]
        if "skip" in res:
            pytest.skip(res["skip"])
        assert res["error"] == "" and res["rows"], (seed, res)
        for row in res["rows"]:
            assert row["backend"] == "nccl" and "nccl" in row["describe"] and "undefined" not in row["describe"], row
            assert row["err"] <= 1e-5, (seed, row)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_nccl_pairs_of_a_larger_job_and_a_bound_device_over_a_pair():
    # Pairs whose members made different numbers of groups before: each pair's configuration works (its
    # group's name comes from its ranks and configuration). With a bound device, a configuration over a
    # pair is refused at once, saying what to pass.
    ranks, seed = _layouts("pairs", 4)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        assert len(r["result"]["rows"]) == 2 and all(row["err"] <= 1e-5 for row in r["result"]["rows"])
    ranks, seed = _layouts("bound", 4)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        if "skip" in r["result"]:
            pytest.skip(r["result"]["skip"])
        assert "initialised with device_id=" in r["result"]["error"] and "without device_id=" in r["result"]["error"]
