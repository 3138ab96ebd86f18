"""Context-parallel attention (``lib_attn.parallel``) with real processes on gloo.

Each world size is launched once (tests/parallel_cases.py, through ``launch.run_ranks``): every rank
runs every mode of its grid (Ulysses, ring, Ulysses x ring), every kind of call (self, cross, joint
with the text in front and at the back), even and uneven lengths (and fewer tokens than ranks),
head counts that do and do not divide the Ulysses degree (padded, or run as a ring), in float32 and
float64, on fresh random inputs, and compares its share of the output with a float64 reference of
the whole call. The bounds are tied to the dtype: ``BOUND_EPS`` machine epsilons of it. Job layouts
have their own launches: 8 ranks as two jobs of 4, two configurations used from two threads, and
torch.distributed initialised without a backend.
"""
import os
import random

import pytest
import torch

from lib_attn import Report
from lib_attn.parallel import launch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "parallel_cases.py")
BOUND_EPS = 100
BOUNDS = {"torch.float32": BOUND_EPS * torch.finfo(torch.float32).eps,
          "torch.float64": BOUND_EPS * torch.finfo(torch.float64).eps}

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

_runs: dict = {}


def _cases(world: int):
    """Every rank's results for ``world`` ranks (launched once per session), and the seed."""
    if world not in _runs:
        seed = random.SystemRandom().randrange(2**31)
        _runs[world] = (launch.run_ranks(world, [CASES, "cases", str(seed)], timeout=240), seed)
    ranks, seed = _runs[world]
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} of {world} (seed {seed}) failed:\n{r['output']}"
    return [r["result"] for r in ranks], seed


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_matches_one_process(world):
    results, seed = _cases(world)
    for res in results:
        cases = res["results"]
        bad = [c for c in cases if not c["err"] <= BOUNDS[c["dtype"]]]
        assert bad == [], f"rank {res['rank']} of {world}, seed {seed}: {bad[:5]}"
        # What was covered, so that a case silently dropped fails here.
        grids = {c["grid"] for c in cases}
        assert grids == ({"1x2", "2x1"} if world == 2 else {"1x4", "4x1", "2x2"})
        assert {c["kind"] for c in cases} == {"self", "cross", "joint", "joint-back", "joint bshd"}
        assert {c["dtype"] for c in cases} == set(BOUNDS)
        assert any(c["n"] % world for c in cases) and any(c["n"] % world == 0 for c in cases)
        assert any(c["n"] < world for c in cases)  # a rank with no token


@pytest.mark.parametrize("world", [2, 4])
def test_each_call_is_counted_with_its_mode_and_traffic(world):
    results, seed = _cases(world)
    for res in results:
        for c in res["results"]:
            assert c["counted"] == 1, (seed, c)
            if c["kind"] == "cross":
                assert c["modes"] == ["local"] and c["bytes"] == 0, (seed, c)
            elif c["n"] >= world:  # below that, a rank may have nothing to send
                assert c["bytes"] > 0, (seed, c)
        # Heads that do not divide: padded under "pad", a ring over every rank under "ring".
        uneven = [c for c in res["results"] if c["heads"] == 3 and c["kind"] != "cross" and c["grid"] != f"1x{world}"]
        assert uneven and all(c["modes"] == (["ring"] if c["uneven_heads"] == "ring" else
                                             ["ulysses" if c["grid"] == f"{world}x1" else "ulysses-ring"])
                              for c in uneven), uneven[:3]


def test_the_readout_json_says_parallel_ranks_mode_and_bytes():
    results, _ = _cases(2)
    for res in results:
        rows = res["report"]["parallel"]
        assert len(rows) == 1
        row = rows[0]
        # One self call of 2 x 4 heads x 8 tokens x 8 dims in fp32, Ulysses over 2 ranks: q, k, v half out and
        # the output half back, 4 tensors x 2 x 2 heads x 4 tokens x 8 x 4 bytes sent by each rank.
        assert (row["mode"], row["ranks"], row["ulysses"], row["ring"], row["count"]) == ("ulysses", 2, 2, 1, 1)
        assert row["bytes_sent"] == row["bytes_per_call"] == 4 * 2 * 2 * 4 * 8 * 4
        again = Report.from_dict(res["report"])
        assert again.to_dict()["parallel"] == rows


def test_an_all_zero_lse_is_caught_and_the_step_recomputed():
    results, seed = _cases(2)
    for res in results:
        zero = res["zero_lse"]
        assert zero["err"] <= BOUNDS["torch.float64"], (seed, zero)
        assert ["dit", "sdpa", "ring step: log-sum-exp is all zero", "next backend", True] in zero["guard"]
        assert ["dit", "math"] in zero["calls"]


@pytest.mark.parametrize("world", [2, 4])
def test_the_checks_can_fail(world):
    # The same harness with the ring's merge broken reports an error far above any bound.
    results, _ = _cases(world)
    assert all(res["broken_merge"] > 1000 * BOUNDS["torch.float64"] for res in results)


@pytest.mark.parametrize("how", ["raise", "step", "stall"])
def test_a_rank_that_raises_or_stalls_ends_the_run_on_every_rank(how):
    timeout = 2
    ranks = launch.run_ranks(2, [CASES, "fault", "7", how], timeout=60,
                             env={"PARALLEL_TIMEOUT": str(timeout), "PARALLEL_STALL": "3.5"})
    for r in ranks:
        assert r["returncode"] == 1 and r["result"], r
    first, second = (r["result"] for r in ranks)
    assert "ParallelError: rank 0 of 2" in first["error"] and "peer rank raised, left, or stalled" in first["error"]
    assert first["seconds"] < timeout + 3, first
    if how == "stall":
        # The stalled rank finds its peer gone when it comes back: a clear error too, no hang.
        assert "ParallelError: rank 1 of 2" in second["error"], second
    else:
        assert "injected failure" in second["error"], second


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_disagree_on_a_call_all_raise_the_same_error_at_once(world):
    results, _ = _cases(world)
    errors = [res["mismatch"]["error"] for res in results]
    for res, error in zip(results, errors):
        assert "the ranks disagree on this self call" in error and "differ in heads 4 vs 2" in error, error
        assert res["mismatch"]["seconds"] < 10
        assert res["mismatch"]["err_after"] <= BOUNDS["torch.float64"]  # the group still works
    assert len({e.split(": ", 1)[1] for e in errors}) == 1  # the same words on every rank, after its name


@pytest.mark.parametrize("world", [2, 4])
def test_a_ring_step_issues_no_ungrouped_send_or_receive(world):
    # NCCL completes a ring step only when its send and receive are grouped (batch_isend_irecv): the
    # ranks count every point-to-point call made outside a batch, over every grid with a ring.
    results, seed = _cases(world)
    for res in results:
        grouped = res["grouped"]
        assert grouped["ungrouped"] == 0, (seed, grouped)
        assert grouped["batches"] > 0 and grouped["grouped"] == 2 * grouped["batches"], (seed, grouped)
        assert grouped["err"] <= BOUNDS["torch.float64"], (seed, grouped)


def test_a_rank_back_from_one_out_of_memory_returns_to_its_kernel():
    # Rank 1's kernel raises one out-of-memory in its first ring step: the step is recomputed on the next
    # backend, the kernel sits out RETRY_AFTER ring steps of that signature (each counted as a fallback),
    # then rank 1 runs on it again, as rank 0 did throughout; every result stays within the bound.
    from lib_attn.parallel import local

    results, seed = _cases(2)
    first, second = sorted(results, key=lambda r: r["rank"])
    for res in (first, second):
        assert all(p["err"] <= BOUNDS["torch.float32"] for p in res["transient"]["phases"]), (seed, res["transient"])
    assert second["transient"]["failures"] == 1
    assert all(set(p["calls"]) == {"dit/sdpa"} and not p["fallbacks"] for p in first["transient"]["phases"])
    during, after = second["transient"]["phases"][:2], second["transient"]["phases"][2]
    # the failed step recomputed, then the RETRY_AFTER steps sat out, as docs/parallel.md says
    assert sum(p["calls"].get("dit/math", 0) for p in during) == 1 + local.RETRY_AFTER
    fallbacks = [f for p in during for f in p["fallbacks"]]
    assert fallbacks and all(f.startswith("sdpa/failed at run time: RuntimeError: CUDA out of memory") and
                             f.endswith(f"tried again after {local.RETRY_AFTER} ring steps") for f in fallbacks)
    assert set(after["calls"]) == {"dit/sdpa"} and not after["fallbacks"]  # back on its kernel


@pytest.mark.parametrize("world", [2, 4])
def test_the_text_of_a_joint_call_is_the_same_bytes_on_every_rank_in_ring_modes(world):
    results, seed = _cases(world)
    bounds = {**BOUNDS, "torch.bfloat16": BOUND_EPS * torch.finfo(torch.bfloat16).eps}
    for res in results:
        rows = res["text_identical"]
        assert {r["grid"] for r in rows} == ({"1x2"} if world == 2 else {"1x4", "2x2"})
        assert {r["dtype"] for r in rows} == {"torch.float32", "torch.bfloat16"}
        for row in rows:
            assert row["identical"], (seed, row)
            assert row["err"] <= bounds[row["dtype"]], (seed, row)


def test_sparse_attention_runs_under_ulysses_and_says_why_ring_steps_run_dense():
    ranks = launch.run_ranks(2, [CASES, "sparse", "11"], timeout=240)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], r["output"]
        res = r["result"]
        ulysses, ring = res["ulysses"], res["ring"]
        # Ulysses: each rank attends over the whole sequence for its heads, sparse, within the budget
        assert ulysses["sparse_calls"] == 1 and ["dit", "block-sparse"] in ulysses["calls"], res
        assert ulysses["error_max"] <= 0.2 and 0 < ulysses["err"] <= 0.2
        # ring: the steps run dense, each counted as a fallback from the sparse backend with the reason
        assert ring["sparse_calls"] == 0 and ring["err"] < 1e-5
        reasons = [reason for role, backend, reason in ring["fallbacks"] if backend == "block-sparse"]
        assert reasons and all("runs under Ulysses only" in reason for reason in reasons)


def test_each_live_configuration_has_its_own_groups_and_a_later_one_reuses_them():
    from lib_attn.parallel import mesh

    results, seed = _cases(4)
    for res in results:
        groups = res["groups"]
        assert groups["channels"] == [0, 1] and groups["own_groups"], (seed, groups)
        assert groups["reused"], (seed, groups)  # made after both were gone: channel 0's groups again
        assert groups["cycle_channel"] == 1, (seed, groups)  # one freed by a cycle: alike on every rank
        assert groups["err"] <= BOUNDS["torch.float64"], (seed, groups)
        # A group torch destroyed is dropped from the cache and made anew under another name.
        remade = groups["remade"]
        assert remade["before"] != remade["after"] and remade["dropped"], (seed, remade)
        assert remade["after"] == mesh.group_name("all", tuple(groups["pair_ranks"]),
                                                  (tuple(groups["pair_ranks"]), 1, 2, 30.0, "gloo"), 0, 1)


def test_pairs_whose_members_made_different_groups_before_name_their_groups_alike():
    # Rank r made r groups of its own before: torch's own naming (from how many groups a process holds,
    # or which names it took) would name each pair's group apart on its two members, which would then
    # wait on different store keys. The names come from the ranks and the configuration alone.
    from lib_attn.parallel import mesh

    results, seed = _cases(4)
    by_pair = {}
    for res in results:
        groups = res["groups"]
        pair = tuple(groups["pair_ranks"])
        by_pair.setdefault(pair, []).append(groups["pair_names"])
        for grid, name in groups["pair_names"].items():
            u, r = (int(x) for x in grid.split("x"))
            assert name == mesh.group_name("all", pair, (pair, u, r, 30.0, "gloo"), 0), (grid, name)
    assert sorted(by_pair) == [(0, 1), (2, 3)]
    assert all(names[0] == names[1] for names in by_pair.values()), by_pair


def test_two_jobs_of_four_in_one_world_each_make_only_their_own_grid():
    # 8 ranks, two jobs of 4: each job's processes make only their Parallel(ulysses=2, ring=2, group=...),
    # the second job after other configurations and groups. Every rank's share equals one process.
    seed = random.SystemRandom().randrange(2**31)
    ranks = launch.run_ranks(8, [CASES, "jobs", str(seed)], timeout=480)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        res = r["result"]
        assert res["job_ranks"] == ([0, 1, 2, 3] if r["rank"] < 4 else [4, 5, 6, 7])
        assert {(row["grid"], row.get("kind")) for row in res["rows"]} >= {("2x2", "self"), ("2x2", "joint")}
        assert all(row["err"] <= 1e-12 for row in res["rows"]), (seed, res)
        assert res["seconds"] < 30, res


@pytest.mark.parametrize("grids", ["2x1,2x1", "1x2,1x2", "2x1,1x2"])
def test_two_configurations_used_at_once_from_two_threads_each_have_their_own_channel(grids):
    # Two pipelines over the same 2 ranks, each with its configuration, 20 calls each in two threads at
    # once: every call equals one process (before, both shared one group and every thread stalled).
    seed = random.SystemRandom().randrange(2**31)
    ranks = launch.run_ranks(2, [CASES, "threads", str(seed), grids], timeout=180)
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        res = r["result"]
        for row in res["rows"]:
            assert row["error"] == "" and row["calls"] == 20, (seed, row)
            assert row["err"] <= BOUNDS["torch.float64"] and row["seconds"] < 20, (seed, row)
        assert res["channels"] == ([0, 1] if grids.split(",")[0] == grids.split(",")[1] else [0, 0])
        # One configuration held by one thread and called from another: refused at once, naming both.
        refused = res["refused"]
        assert f"rank {r['rank']} of 2: " in refused["error"] and "(channel 0) is in use by pipeline-0 while " \
            "MainThread calls through it" in refused["error"], refused
        assert refused["seconds"] < 0.5, refused


@pytest.mark.parametrize("name", ["none", "cpu:gloo"])
def test_the_backend_is_read_for_the_tensors_device_as_torch_reads_it(name):
    # init_process_group() without a backend (torch says 'undefined') or as 'device:backend' pairs: the
    # configuration reads the group's backend for the tensors' device (gloo for CPU here, NCCL for CUDA
    # tensors on GPUs: tests/gpu), relabels bfloat16 for gloo, and says which backend in describe().
    seed = random.SystemRandom().randrange(2**31)
    ranks = launch.run_ranks(2, [CASES, "backend", str(seed), name], timeout=120)
    bounds = {**BOUNDS, "torch.bfloat16": BOUND_EPS * torch.finfo(torch.bfloat16).eps}
    for r in ranks:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {seed}):\n{r['output']}"
        res = r["result"]
        if "init_error" in res:  # torch's own refusal, before any configuration: nothing of ours to test
            assert name == "none" and "no GPUs found" in res["init_error"], res
            pytest.skip(f"torch {torch.__version__} cannot initialise without a backend here: {res['init_error']}")
        assert res["cpu"] == "gloo" and res["describe"].endswith(", gloo)"), res
        assert len(res["rows"]) == 4 and all(row["err"] <= bounds[row["dtype"]] for row in res["rows"]), (seed, res)
