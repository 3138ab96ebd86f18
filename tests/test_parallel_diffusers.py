"""``route(model, parallel=...)`` on tiny random-weight diffusers models (Flux, Wan, a UNet) split over 2
real processes on gloo, started by torchrun: each rank's output equals the one-process routed output in float64, and its
readout counts the split calls with their mode and bytes (so a split that did not happen fails)."""
import os
import random

import pytest
import torch

from lib_attn.parallel import launch

try:
    import diffusers  # noqa: F401
except Exception as exc:  # noqa: BLE001 - diffusers 0.35+ needs a newer torch than 2.1 (it reads torch.xpu)
    pytest.skip(f"diffusers does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
BOUND = 100 * torch.finfo(torch.float64).eps
_run: dict = {}


def _results():
    if not _run:
        seed = random.SystemRandom().randrange(2**31)
        _run["seed"] = seed
        # Through torchrun itself, as a user would run a script.
        _run["ranks"] = launch.run_torchrun(2, [os.path.join(HERE, "parallel_diffusers_cases.py"), str(seed)],
                                            timeout=300, env={"OMP_NUM_THREADS": "1"})
    for r in _run["ranks"]:
        assert r["returncode"] == 0 and r["result"], f"rank {r['rank']} (seed {_run['seed']}):\n{r['output']}"
    return [r["result"] for r in _run["ranks"]], _run["seed"]


@pytest.mark.parametrize("model", ["flux", "wan", "unet"])
def test_a_split_model_gives_the_one_process_output(model):
    results, seed = _results()
    for res in results:
        rows = res["models"][model]["rows"]
        assert set(rows) == {"2x1", "1x2"}
        for grid, row in rows.items():
            assert row["shape_ok"] and row["err"] <= BOUND, (seed, res["rank"], grid, row["err"])


@pytest.mark.parametrize("model, kinds", [("flux", {"joint"}), ("wan", {"self", "cross"}), ("unet", {"self", "cross"})])
def test_each_rank_counts_its_split_calls(model, kinds):
    results, _ = _results()
    for res in results:
        for grid, row in res["models"][model]["rows"].items():
            table = row["parallel"]  # [role, kind, mode, ranks, ulysses, ring, note, calls, bytes]
            assert {entry[1] for entry in table} == kinds
            mode = "ulysses" if grid == "2x1" else "ring"
            for entry in table:
                assert entry[3] == 2 and entry[7] > 0
                assert entry[2] == ("local" if entry[1] == "cross" else mode)
                assert (entry[8] > 0) == (entry[1] != "cross")
            # Every attention call of the model was split or served locally: as many as on one process.
            assert sum(entry[7] for entry in table) == res["models"][model]["one_process_calls"]


def test_flux_heads_that_do_not_divide_are_padded_and_said():
    results, _ = _results()
    notes = {entry[6] for res in results for entry in res["models"]["flux"]["rows"]["2x1"]["parallel"]}
    assert notes == {"heads 3 not divisible by ulysses 2: padded to 4"}


def test_a_model_without_a_known_split_is_refused_by_name():
    results, _ = _results()
    for res in results:
        assert "no known sequence split for Linear" in res["refused"]
        assert "FluxTransformer2DModel, WanTransformer3DModel, UNet2DConditionModel" in res["refused"]
