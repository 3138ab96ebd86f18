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
from diffusers import FluxTransformer2DModel, HunyuanVideoTransformer3DModel, SD3Transformer2DModel  # noqa: E402

from lib_attn import conditioning  # noqa: E402
from lib_attn.integrations import diffusers as routed  # noqa: E402

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
    # the single block's joint call keeps Flux's text tokens (first): the block told them
    assert [key[2] for key in sparse.kinds] == ["block 1, 7 text tokens first; position unknown: dense window 0-20% "
                                                "not applied"]
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


def test_route_checks_sparse_where_the_models_run_not_where_their_weights_wait(monkeypatch):
    # model CPU offload (Accelerate's hook on the model: weights on the CPU, calls on the GPU) and
    # sequential offload (weights on the meta device): the check looks at the execution device
    config_module = sys.modules["lib_attn.config"]
    real, asked = config_module.sparse_problem, []

    def recorded(settings, device=None):
        asked.append(device)
        return real(settings, None if device is not None and device.type == "cuda" else device)

    monkeypatch.setattr(config_module, "sparse_problem", recorded)
    offloaded = flux()
    offloaded._hf_hook = type("CpuOffload", (), {"execution_device": torch.device("cuda", 0)})()
    for target in (offloaded, JointPipeline(offloaded)):
        with route(target, sparse="block-sparse"):
            assert lib_attn.config().sparse.method == "block-sparse"
    assert asked == [torch.device("cuda", 0)] * 2
    on_meta = flux().to("meta")
    with route(on_meta, sparse="block-sparse"):  # this machine's default device decides
        assert lib_attn.config().sparse.method == "block-sparse"
    assert asked[-1] is None


class JointPipeline(diffusers.DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)


def _told(monkeypatch):
    """(layout, sequence length, the conditioning told) of each call route() sends to the engine."""
    seen = []
    real = routed.attention

    def watching(q, k, v, *, layout="bhsd", **kwargs):
        n = q.shape[1 if layout == "bshd" else 2]
        seen.append((n, k.shape[1 if layout == "bshd" else 2], conditioning.current(n)))
        return real(q, k, v, layout=layout, **kwargs)

    monkeypatch.setattr(routed, "attention", watching)
    return seen


def _joint_models():
    torch.manual_seed(1)
    flux_model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()
    sd3 = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=32,
                                pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
                                dual_attention_layers=(0,)).eval()
    hunyuan = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                             num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                                             patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                             rope_axes_dim=(2, 2, 4)).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(8.0), indexing="ij"), -1)
    return [
        (flux_model, dict(hidden_states=torch.randn(2, 32, 4, generator=g), encoder_hidden_states=torch.randn(2, 9, 32, generator=g),
                          pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.full((2,), 0.5),
                          img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(9, 3)), 32, 9, "first", 4),
        (sd3, dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(2, 9, 32, generator=g),
                   pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.full((2,), 10.0)), 16, 9, "last", 2),
        (hunyuan, dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=g), timestep=torch.tensor([10]),
                       encoder_hidden_states=torch.randn(1, 5, 16, generator=g), encoder_attention_mask=torch.ones(1, 5),
                       pooled_projections=torch.randn(1, 8, generator=g), guidance=torch.tensor([3.0])), 32, 5, "last", 2),
    ]


def test_joint_models_tell_their_text_tokens_first_or_last_to_their_joint_calls_only(monkeypatch):
    """Flux: text first in its double and single blocks; SD3: text last (SD3.5's image-only second attention
    is told nothing); HunyuanVideo: text last (its token refiner's text-only calls are told nothing)."""
    for model, kwargs, image, text, side, joint in _joint_models():
        seen = _told(monkeypatch)
        with torch.no_grad(), route(model, sparse="block-sparse, min_tokens=1, dense=none"):
            model(**kwargs)
        name = type(model).__name__
        told = [(n, t) for n, kv, t in seen if t is not None]
        assert told == [(image + text, conditioning.Text(text, image + text, side))] * joint, (name, seen)
        # every other call is not a joint one: another length (cross, image-only, the text refiner's)
        assert all(n != image + text for n, kv, t in seen if t is None), (name, seen)
        assert conditioning.current(image + text) is None
    # a pipeline's transformer, routed through the pipeline, tells them as the model alone does
    model, kwargs, image, text, side, joint = _joint_models()[1]
    seen = _told(monkeypatch)
    with torch.no_grad(), route(JointPipeline(model), sparse="block-sparse, min_tokens=1, dense=none"):
        model(**kwargs)
    assert [t for *_, t in seen if t is not None] == [conditioning.Text(text, image + text, side)] * joint
    # without sparse attention nothing is hooked
    model, kwargs, image, text, _, _ = _joint_models()[0]
    seen = _told(monkeypatch)
    with torch.no_grad(), route(model):
        model(**kwargs)
    assert seen and all(t is None for *_, t in seen)
