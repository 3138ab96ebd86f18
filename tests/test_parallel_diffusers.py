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


@pytest.mark.parametrize("processor", ["AttnProcessor", "SlicedAttnProcessor"])
def test_a_unet_with_matmul_processors_is_split_and_equals_one_process(processor):
    # diffusers' AttnProcessor (set_default_attn_processor) and SlicedAttnProcessor (attention slicing)
    # compute attention with matmuls, out of the engine's reach: split as AttnProcessor2_0, never left to
    # attend to one rank's share. The reference is the same model on one process, on its own processor.
    results, seed = _results()
    for res in results:
        rows = {k: v for k, v in res["processors"].items() if k.startswith(processor + " ")}
        assert set(rows) == {f"{processor} 2x1", f"{processor} 1x2"}
        for grid, row in rows.items():
            assert row["held"] == [processor] and row["after"] == [processor], row  # given back after the scope
            assert row["err"] <= BOUND, (seed, res["rank"], grid, row["err"])
            # Every attention call of the UNet went through the split: as many as with the default processor.
            assert row["split"] == res["models"]["unet"]["one_process_calls"], row


@pytest.mark.parametrize("case, words", [
    ("xformers", ["4 attention module(s) with XFormersAttnProcessor",
                  "down_blocks.0.attentions.0.transformer_blocks.0.attn1"]),
    ("own", ["1 attention module(s) with _OwnProcessor", "dispatcher): down_blocks.0.attentions.0.transformer_blocks.0.attn1",
             "neither through F.scaled_dot_product_attention nor through diffusers' attention dispatcher"]),
    ("first block cache", ["'fbc_leader_block_hook' (FBCHeadBlockHook) on transformer_blocks.0",
                           "First Block Cache decides from this rank's share"]),
    ("layer skip", ["(AttentionProcessorSkipHook) on down_blocks.0.attentions.0.transformer_blocks.0.attn1: it skips "
                    "attention scores"]),
    ("ip-adapter", ["transformer_blocks.0.attn: FluxIPAdapterAttnProcessor (IP-Adapter)"]),
])
def test_what_the_split_cannot_reach_is_refused_before_the_model_runs(case, words):
    results, _ = _results()
    for res in results:
        refusal = res["refusals"][case]
        assert refusal["error"].startswith("route(parallel=...) cannot split this model"), refusal
        for word in words:
            assert word in refusal["error"], (word, refusal["error"])
        assert refusal["ran"] == 0  # refused at route(), before the first step: no rank waits on another


def test_a_rank_that_fails_inside_a_split_model_ends_every_rank_with_a_clear_error():
    results, _ = _results()
    first, second = sorted(results, key=lambda r: r["rank"])
    assert second["fault"]["error"] == "RuntimeError: injected failure on rank 1"
    assert first["fault"]["error"].startswith("ParallelError: rank 0 of 2 (ring): ring step"), first["fault"]
    assert first["fault"]["seconds"] < 3 + 3


def test_ip_adapter_masks_on_a_split_unet_are_refused_on_every_rank():
    results, _ = _results()
    for res in results:
        assert res["refusals"]["ip masks"].startswith("route(parallel=...): IP-Adapter masks"), res["refusals"]


@pytest.mark.parametrize("case", ["AttnProcessor", "slicing", "PAG", "own cross"])
def test_a_processor_set_inside_the_scope_is_split_and_equals_one_process(case):
    # Set after route(parallel=) opened (set_attn_processor, enable_attention_slicing, a PAG pipeline's own
    # processors, a user's processor on cross-attention): routed at its module's first call, or left as it is
    # where every rank holds every key; either way the one-process output of the same setup.
    results, seed = _results()
    for res in results:
        row = res["inside"][case]
        assert row["error"] == "" and row["err"] <= BOUND, (seed, res["rank"], row)
        assert row["split"] > 0 and row["after"] == [], row  # split, and given back when the scope closed


@pytest.mark.parametrize("case, words", [
    ("own self", ["down_blocks.0.attentions.0.transformer_blocks.0.attn1 was given _OwnProcessor after the split opened"]),
    ("xformers", ["down_blocks.0.attentions.0.transformer_blocks.0.attn1 was given XFormersAttnProcessor"]),
    ("SEG", ["hook 'seg' (SmoothedEnergyGuidanceHook) on down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
             "added after route() opened"]),
    ("first block cache", ["'fbc_leader_block_hook' (FBCHeadBlockHook) on transformer_blocks.0",
                           "added after route() opened"]),
    ("flux ip-adapter", ["transformer_blocks.0.attn was given FluxIPAdapterAttnProcessor after the split opened: "
                         "FluxIPAdapterAttnProcessor (IP-Adapter) makes a second attention call"]),
])
def test_what_is_set_inside_the_scope_and_cannot_be_split_is_refused_on_every_rank(case, words):
    results, _ = _results()
    errors = set()
    for res in results:
        row = res["inside"][case]
        for word in words:
            assert word in row["error"], (word, row)
        errors.add(row["error"])
        # Hooks are refused as the denoiser is called, before any block (and so any exchange) runs.
        assert case not in ("SEG", "first block cache") or row["blocks_ran"] == 0, row
    assert len(errors) == 1  # the same refusal on every rank: none waits on another
