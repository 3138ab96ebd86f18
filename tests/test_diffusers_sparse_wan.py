"""Sparse attention engaged in a diffusers Wan 2.1 run (``tools/sparse_wan.py``): a random-weight
WanTransformer3DModel whose self-attention is RoPE's position term alone, at 12,288 tokens, sampled with
CFG as WanPipeline samples (its own class where ``transformers`` imports, else the same loop), through
``route(pipe, sparse=...)`` with the engine's defaults. The readout counts the sparse calls by kind and the
dense ones by reason, and every error it reports agrees with a float64 recomputation of the same call's
returned output, read by hooks outside the route."""
from __future__ import annotations

import os
import sys

import pytest

import lib_attn
from lib_attn import readout

try:
    import diffusers  # noqa: F401
except Exception as exc:  # noqa: BLE001 - diffusers 0.35+ needs a newer torch than 2.1 (it reads torch.xpu)
    pytest.skip(f"diffusers does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import sparse_wan  # noqa: E402

STEPS = 3  # step 0 in the default window 0-20%; steps 1 and 2 in the bands 20-40% and 60-80%


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def test_a_wan_run_at_12288_tokens_goes_sparse_where_it_may_and_its_errors_are_float64s():
    args = sparse_wan.parse([f"--steps={STEPS}", "--layers=2", "--heads=1", "--rows=768"])
    result = sparse_wan.run(args, "block-sparse")
    sparse = result["report"].sparse
    # block 0 is the window 'first 1'; step 0 the window 0-20%; cross-attention never goes sparse; every
    # other self-attention call (block 1, steps 1 and 2, the cond and the uncond pass) runs sparse
    assert sparse.dense == {("dit", "cross-attention"): 2 * STEPS * 2, ("dit", "dense window: 0-20%"): 2 * 2,
                            ("dit", "dense window: first 1"): 2 * (STEPS - 1)}
    kinds = {kind: n for (role, backend, kind, setting), n in sparse.kinds.items()}
    assert kinds == {"block 1, 20-40%": 1, "block 1, 20-40%, call 2 of the step": 1, "block 1, 60-80%": 1,
                     "block 1, 60-80%, call 2 of the step": 1}
    assert not sparse.replaced and sparse.measured == 4  # each kind's one call calibrated it, measured
    text = readout.text(result["report"])
    assert "sparse ×4 (block-sparse, budget=0.15, min_tokens=12288, topk=0.1, dense=0-20%; first 1)" in text
    # every self-attention call seen by the hooks: 12,288 tokens; the dense ones exact, the sparse ones
    # within the budget against float64, each agreeing with what the readout measured for its kind
    calls = result["calls"]
    assert len(calls) == 2 * STEPS * 2
    found = {}
    for model_call, block, error in calls:
        kind = sparse_wan.kind_of(model_call, block, STEPS)
        if kind in kinds:
            found[kind] = error
        else:
            assert error <= 1e-5, (kind, error)
    assert found.keys() == kinds.keys()
    for (role, backend, kind, setting), n in sparse.kinds.items():
        measured = sparse.error_max((role, backend, kind, setting))
        assert 1e-3 < found[kind] <= sparse.budget
        assert measured == pytest.approx(found[kind], rel=0.2), kind
    assert result["tokens"] == 12288 and result["pipeline"] in ("WanPipeline", "WanLoop")

