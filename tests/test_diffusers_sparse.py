"""Sparse attention through lib_attn.integrations.diffusers.route on a small random-weight Flux transformer
at 12,288 image tokens on the CPU: the readout counts sparse and dense calls, and every error it reports
agrees with a float64 reference of the same call."""
from __future__ import annotations

import math
import sys

import pytest
import torch

import lib_attn
from lib_attn.integrations.diffusers import route
from lib_attn import sparse_measure as measure

from engine_helpers import reference, rel_err

try:
    import diffusers  # noqa: F401
except Exception as exc:  # noqa: BLE001 - diffusers 0.35+ needs a newer torch than 2.1 (it reads torch.xpu)
    pytest.skip(f"diffusers does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)
from diffusers import FluxTransformer2DModel  # noqa: E402

H, W, TEXT = 96, 128, 7  # 12,288 image tokens


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def flux():
    torch.manual_seed(5)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  axes_dims_rope=(4, 4, 8)).eval()


def flux_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(H)), torch.arange(float(W)), indexing="ij"), -1)
    return dict(hidden_states=torch.randn(1, H * W, 4, generator=g), encoder_hidden_states=torch.randn(1, TEXT, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.full((1,), 0.5),
                img_ids=ids.reshape(-1, 3).float(), txt_ids=torch.zeros(TEXT, 3))


def test_a_flux_transformer_at_12288_tokens_runs_sparse_and_reports_float64s_errors(monkeypatch):
    measured = []
    real = measure.output_error

    def keeping(out, q, k, v, scale, layout, samples=None, bound=False):
        error = real(out, q, k, v, scale, layout, samples, bound)
        measured.append((error, out.clone(), q.clone(), k.clone(), v.clone(), scale, layout, samples))
        return error

    monkeypatch.setattr(measure, "output_error", keeping)
    model = flux()
    with torch.no_grad(), route(model, sparse="block-sparse, budget=1, min_tokens=12288") as routing, \
            lib_attn.recording() as rec:
        assert routing.processors == {"dit": 2}
        out = model(**flux_inputs()).sample
    assert torch.isfinite(out).all()
    sparse = rec.sparse
    # block 0 (the double block) is the default dense window 'first 1'; block 1 (the single block) runs sparse,
    # and the readout says the step window 0-20% was not applied: the model ran outside a pipeline's steps
    assert sparse.calls == 1 and sparse.dense == {("dit", "dense window: first 1"): 1}
    assert [key[2] for key in sparse.kinds] == ["block 1; position unknown: dense window 0-20% not applied"]
    assert rec.calls[("dit", "block-sparse")] == 1
    # every error the readout holds is one measured, and each agrees with float64 on the same rows
    reported = sorted(error for (*_, error), n in sparse.errors.items() for _ in range(n))
    assert reported == sorted(round(e[0], 4) for e in measured) and len(measured) == 1
    for error, out_call, q, k, v, scale, layout, s in measured:
        assert layout == "bshd" and q.shape[1] == H * W + TEXT
        qb, kb, vb, ob = (t.transpose(1, 2) for t in (q, k, v, out_call))
        pick = (s.batch[:, None], s.head[:, None], s.rows)  # the rows drawn for the measurement
        want = rel_err(ob[pick], reference(qb, kb, vb, scale=scale)[pick])
        assert error == pytest.approx(want, rel=1e-4, abs=1e-6) and math.isfinite(want)


def test_route_refuses_bad_sparse_settings_before_anything_changes():
    model = flux()
    before = [type(m.processor) for m in model.modules() if hasattr(m, "processor")]
    with pytest.raises(lib_attn.SparseError, match="budget '2'"):
        with route(model, sparse="block-sparse, budget=2"):
            pass
    assert [type(m.processor) for m in model.modules() if hasattr(m, "processor")] == before
    assert lib_attn.config().sparse is None


def test_route_refuses_a_sparse_method_that_cannot_run_on_the_models_device(monkeypatch):
    from lib_attn.kernels import reset_probes

    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # Sol-Attn not installed
    reset_probes()
    model = flux()
    before = [type(m.processor) for m in model.modules() if hasattr(m, "processor")]
    try:
        with pytest.raises(lib_attn.SparseError, match=r"sparse method 'sol' cannot run on this device \(cpu: .*To "
                                                       r"install: pip install comfy-kitchen\. Methods that can run "
                                                       r"here: auto, block-sparse"):
            with route(model, sparse="sol"):
                pass
    finally:
        reset_probes()
    assert [type(m.processor) for m in model.modules() if hasattr(m, "processor")] == before
    assert lib_attn.config().sparse is None
