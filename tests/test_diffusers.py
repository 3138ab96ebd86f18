"""lib_attn.integrations.diffusers.route on tiny random-weight diffusers models built from configs."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import _compat
from lib_attn import schedule as sched
from lib_attn.kernels import REGISTRY
from lib_attn.integrations import diffusers as integration
from lib_attn.integrations.diffusers import route

from engine_helpers import rel_err, spy

try:
    import diffusers
except Exception as exc:  # noqa: BLE001 - diffusers 0.35+ needs a newer torch than 2.1 (it reads torch.xpu)
    pytest.skip(f"diffusers does not import here: {type(exc).__name__}: {exc}", allow_module_level=True)
from diffusers import AutoencoderKL, DiffusionPipeline, FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel  # noqa: E402
from diffusers import (DDIMScheduler, DDPMScheduler, DiTPipeline, DiTTransformer2DModel, DPMSolverMultistepScheduler,  # noqa: E402
                       EulerDiscreteScheduler, HeunDiscreteScheduler, KDPM2DiscreteScheduler, PNDMScheduler, VQModel)
# Kandinsky 2.2's decoder pipelines take image embeddings, so they run without transformers (diffusers'
# top-level names for them are placeholders when transformers is missing: import their modules).
from diffusers.pipelines.kandinsky2_2.pipeline_kandinsky2_2 import KandinskyV22Pipeline  # noqa: E402
from diffusers.pipelines.kandinsky2_2.pipeline_kandinsky2_2_img2img import KandinskyV22Img2ImgPipeline  # noqa: E402
from diffusers.models import attention_dispatch  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402

B = 2
FP32_BOUND = 1e-5


def assert_rounding(out, want, exact):
    """``out`` is the model's own output ``want`` up to kernel rounding. fp32: a relative error under
    FP32_BOUND. bf16: no farther from the fp32 model's output ``exact`` than the model's own bf16 run
    (a path that computes in fp32 may differ from a bf16 kernel by more than either differs from fp32)."""
    if out.dtype == torch.float32:
        assert rel_err(out, want) < FP32_BOUND
    else:
        assert rel_err(out, exact) <= 1.5 * rel_err(want, exact) + 1e-3, (rel_err(out, exact), rel_err(want, exact))


def build(name: str):
    torch.manual_seed({"unet": 1, "vae": 2, "flux": 3, "sd3": 4}[name])
    if name == "unet":
        model = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    elif name == "vae":
        model = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
            layers_per_block=1, norm_num_groups=32, sample_size=32)
    elif name == "flux":
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    else:
        model = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            caption_projection_dim=16, joint_attention_dim=32, pooled_projection_dim=32, out_channels=4,
            pos_embed_max_size=16)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in ("unet", "vae", "flux", "sd3")}


def inputs(name: str, dtype, text: int = 7, seed: int = 0) -> dict:
    """Fresh seeded inputs for one forward pass; ``text`` is the number of text tokens."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    if name == "unet":
        return dict(sample=randn(B, 4, 8, 8), timestep=10, encoder_hidden_states=randn(B, text, 32))
    if name == "vae":
        return dict(sample=randn(B, 3, 16, 16))
    if name == "flux":
        return dict(hidden_states=randn(B, 16, 4), encoder_hidden_states=randn(B, text, 32),
                    pooled_projections=randn(B, 32), timestep=torch.full((B,), 0.5, dtype=dtype),
                    img_ids=torch.arange(48, dtype=dtype).reshape(16, 3) % 4, txt_ids=torch.zeros(text, 3, dtype=dtype))
    return dict(hidden_states=randn(B, 4, 8, 8), encoder_hidden_states=randn(B, text, 32),
                pooled_projections=randn(B, 32), timestep=torch.full((B,), 10.0, dtype=dtype))


ROLE = {"unet": "unet", "vae": "vae", "flux": "dit", "sd3": "dit"}


def forward(model, kwargs):
    with torch.no_grad():
        return model(**kwargs).sample


def default_run(model, kwargs, monkeypatch):
    """The model's own output and how many times it called PyTorch's SDPA."""
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", counting)
        out = forward(model, kwargs)
    return out, len(calls)


def processor_classes(model) -> list:
    return [type(m.processor) for m in model.modules() if getattr(m, "processor", None) is not None]


def registry_state():
    reg = attention_dispatch._AttentionBackendRegistry
    return (reg._active_backend, dict(reg._backends), dict(reg._constraints), dict(reg._supported_arg_names))


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["unet", "vae", "flux", "sd3"])
def test_routed_model_matches_its_own_run_and_every_call_reaches_the_engine(models, name, dtype, monkeypatch):
    kwargs = inputs(name, dtype)
    exact = forward(models[name], {k: v.float() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    model = models[name].to(dtype)
    try:
        want, sdpa_calls = default_run(model, kwargs, monkeypatch)
        assert sdpa_calls > 0
        own_classes, before = processor_classes(model), registry_state()
        with route(model) as routing, lib_attn.recording() as rec:
            out = forward(model, kwargs)
        assert routing.processors == {ROLE[name]: len(own_classes)} and not routing.skipped
        assert rec.total() == sdpa_calls and rec.calls == {(ROLE[name], "sdpa"): sdpa_calls}
        assert not rec.fallbacks
        assert_rounding(out, want, exact)
        # Pinned to the engine's own math path: only calls that reached the engine can run there.
        with route(model), lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
            pinned = forward(model, kwargs)
        assert rec.calls == {(ROLE[name], "math"): sdpa_calls}
        assert_rounding(pinned, want, exact)
        # Nothing stays patched.
        assert processor_classes(model) == own_classes and registry_state() == before
        with lib_attn.recording() as rec:
            again = forward(model, kwargs)
        assert rec.total() == 0 and torch.equal(again, want)
    finally:
        model.float()


def test_unet_encoder_attention_mask_equals_removing_the_padded_tokens(models):
    model = models["unet"]
    full = inputs("unet", torch.float32, text=9)
    keep = torch.ones(B, 9)
    keep[:, 6:] = 0
    short = dict(full, encoder_hidden_states=full["encoder_hidden_states"][:, :6])
    want = forward(model, short)
    with route(model), lib_attn.recording() as rec:
        out = forward(model, dict(full, encoder_attention_mask=keep))
    assert rel_err(out, want) < 1e-5 and rec.total() == 8
    with route(model), lib_attn.use(preference=["math"]):
        assert rel_err(forward(model, dict(full, encoder_attention_mask=keep)), want) < 1e-5


def test_flux_joint_mask_equals_removing_the_padded_tokens(models):
    model = models["flux"]
    full = inputs("flux", torch.float32, text=9)
    keep = torch.ones(B, 9 + 16, dtype=torch.bool)
    keep[:, 5:9] = False  # the text tokens come first in Flux's joint sequence
    short = dict(full, encoder_hidden_states=full["encoder_hidden_states"][:, :5], txt_ids=full["txt_ids"][:5])
    want = forward(model, short)
    for pinned in (["math"], "auto"):
        with route(model), lib_attn.use(preference=pinned), lib_attn.recording() as rec:
            out = forward(model, dict(full, joint_attention_kwargs={"attention_mask": keep}))
        assert rel_err(out, want) < 1e-5
        assert rec.total() == 2 and not rec.fallbacks


def test_dispatcher_mask_is_handed_to_the_engine_as_a_key_padding_mask(models, monkeypatch):
    seen = []
    real = lib_attn.attention

    def spy(q, k, v, **kw):
        seen.append((kw["layout"], None if kw["mask"] is None else tuple(kw["mask"].shape)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(integration, "attention", spy)
    full = inputs("flux", torch.float32, text=9)
    keep = torch.ones(B, 25, dtype=torch.bool)
    with route(models["flux"]):
        forward(models["flux"], dict(full, joint_attention_kwargs={"attention_mask": keep}))
    assert seen == [("bshd", (B, 1, 1, 25))] * 2


def test_unserved_calls_run_on_pytorch_sdpa_and_are_counted(models):
    q, k, v = (torch.randn(B, 2, 10, 16) for _ in range(3))
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with route(models["unet"]) as routing, route(models["flux"]), lib_attn.recording() as rec:
        unet_call = next(type(m.processor).__call__ for m in models["unet"].modules() if hasattr(m, "processor"))
        flux_call = next(type(m.processor).__call__ for m in models["flux"].modules() if hasattr(m, "processor"))
        via_sdpa_path = unet_call.__globals__["F"].scaled_dot_product_attention(q, k, v, is_causal=True)
        dispatch = flux_call.__globals__["dispatch_attention_fn"]
        via_dispatcher = dispatch(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
        gqa = dispatch(q.transpose(1, 2), k[:, :1].transpose(1, 2), v[:, :1].transpose(1, 2), enable_gqa=True)
    assert routing.processors == {"unet": 8}
    assert torch.equal(via_sdpa_path, causal) and rel_err(via_dispatcher, causal) < 1e-6
    assert rel_err(gqa.transpose(1, 2), F.scaled_dot_product_attention(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v))) < 1e-6
    assert rec.calls == {}
    assert rec.fallbacks == {("unet", "lib_attn", "causal mask: ran on PyTorch SDPA"): 1,
                             ("dit", "lib_attn", "causal mask: ran on diffusers' native backend"): 1,
                             ("dit", "lib_attn", "grouped-query heads: ran on diffusers' native backend"): 1}


def test_an_unrouted_model_keeps_its_own_attention_inside_the_scope(models):
    other = build("flux")
    kwargs = inputs("flux", torch.float32)
    want = forward(other, kwargs)
    with route(models["flux"]), lib_attn.recording() as rec:
        out = forward(other, kwargs)
        forward(models["flux"], kwargs)
    assert torch.equal(out, want) and rec.calls == {("dit", "sdpa"): 2}


def test_a_backend_chosen_on_the_model_is_routed_and_restored(models):
    model = build("flux")
    model.set_attention_backend("native")
    chosen = [m.processor._attention_backend for m in model.modules() if hasattr(m, "processor")]
    with route(model), lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
        forward(model, inputs("flux", torch.float32))
    assert rec.calls == {("dit", "math"): 2}
    assert [m.processor._attention_backend for m in model.modules() if hasattr(m, "processor")] == chosen


class TinyPipeline(DiffusionPipeline):
    def __init__(self, unet, vae, text_encoder):
        super().__init__()
        self.register_modules(unet=unet, vae=vae, text_encoder=text_encoder)


def test_pipeline_routes_denoiser_and_vae_and_leaves_text_encoders(models):
    text_encoder = torch.nn.Sequential(Attention(query_dim=32, heads=2, dim_head=16))
    pipe = TinyPipeline(models["unet"], models["vae"], text_encoder)
    with route(pipe) as routing, lib_attn.recording() as rec:
        inside = type(text_encoder[0].processor)
        forward(models["unet"], inputs("unet", torch.float32))
        forward(models["vae"], inputs("vae", torch.float32))
        text_encoder(torch.randn(1, 5, 32))
    assert routing.processors == {"unet": 8, "vae": 2}
    assert not integration.is_routed(text_encoder[0].processor) and inside is type(text_encoder[0].processor)
    assert rec.calls == {("unet", "sdpa"): 8, ("vae", "sdpa"): 2}
    with route(pipe, role="dit") as routing:
        assert routing.processors == {"dit": 10}


def test_the_shared_processor_of_set_default_attn_processor_is_routed_and_gives_the_same_image(models, caplog):
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    unet, vae = build("unet"), build("vae")
    pipe = TinyPipeline(unet, vae, torch.nn.Sequential())
    kwargs, vae_kwargs = inputs("unet", torch.float32), inputs("vae", torch.float32)
    want, want_vae = forward(unet, kwargs), forward(vae, vae_kwargs)
    unet.set_default_attn_processor()
    vae.set_default_attn_processor()
    assert set(processor_classes(unet)) == {AttnProcessor}  # one shared object
    own = forward(unet, kwargs)
    with caplog.at_level(logging.WARNING, logger="lib_attn"), route(pipe) as routing, lib_attn.recording() as rec:
        out, out_vae = forward(unet, kwargs), forward(vae, vae_kwargs)
    assert routing.processors == {"unet": 1, "vae": 1} and not routing.skipped and not caplog.records
    assert rec.calls == {("unet", "sdpa"): 8, ("vae", "sdpa"): 2}
    assert rel_err(out, own) < FP32_BOUND and rel_err(out, want) < FP32_BOUND and rel_err(out_vae, want_vae) < FP32_BOUND
    assert set(processor_classes(unet)) == {AttnProcessor}  # given back at the scope's end
    assert AttnProcessor2_0 not in processor_classes(unet)


def test_a_shared_processor_on_a_module_computing_other_attention_is_left_with_a_warning(caplog):
    from diffusers.models.attention_processor import AttnProcessor
    attn = Attention(query_dim=32, heads=2, dim_head=16, qk_norm="layer_norm")
    attn.set_processor(AttnProcessor())
    model = torch.nn.Sequential(attn)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        want = attn(x)
    with caplog.at_level(logging.WARNING, logger="lib_attn"), route(model, role="dit") as routing, \
            lib_attn.recording() as rec, torch.no_grad():
        out = attn(x)
    assert routing.skipped == {"AttnProcessor": 1} and not routing.processors and not rec.calls
    assert torch.equal(out, want)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("route: 1 AttnProcessor left as they are, outside lib_attn and not counted: AttnProcessor: it has "
                    "query/key norms, which AttnProcessor does not apply")


def test_a_module_with_no_attention_gets_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="lib_attn"), route(torch.nn.Linear(4, 4), role="dit") as routing:
        pass
    assert not routing.processors and not routing.skipped
    assert [r.getMessage() for r in caplog.records] == ["route: no attention module in Linear: nothing is routed"]


def test_route_restores_everything_after_an_exception(models):
    own, before = processor_classes(models["flux"]), registry_state()
    with pytest.raises(RuntimeError, match="boom"):
        with route(models["flux"]):
            assert integration.REGISTRY_KEY in attention_dispatch._AttentionBackendRegistry._backends
            raise RuntimeError("boom")
    assert processor_classes(models["flux"]) == own and registry_state() == before


def test_unknown_diffusers_is_refused_plainly_for_dispatcher_models(models, monkeypatch):
    monkeypatch.setattr(diffusers, "__version__", "0.34.0")
    with pytest.raises(RuntimeError, match="diffusers 0.34.0"):
        with route(models["flux"]):
            pass
    with route(models["unet"]) as routing:  # SDPA processors need no private API
        assert routing.processors == {"unet": 8}


def test_bad_arguments():
    with pytest.raises(ValueError, match="role"):
        with route(torch.nn.Linear(2, 2), role="decoder"):
            pass
    with pytest.raises(TypeError, match="pipeline"):
        with route(object()):
            pass


@pytest.mark.skipif(_compat.CUSTOM_OP is None, reason="torch.library.custom_op needs torch 2.4")
def test_compiled_routed_model_one_graph_counted_and_configured_at_run_time(models, monkeypatch):
    """Flux through the dispatcher registry under Inductor: 24 runs, with and without a recording."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sdpa_ran, math_ran = spy(monkeypatch, "sdpa"), spy(monkeypatch, "math")
    model = models["flux"]
    kwargs = inputs("flux", torch.float32)
    want = forward(model, kwargs)
    try:
        with route(model):
            compiled = torch.compile(model, fullgraph=True)
            for run in range(24):
                with torch.no_grad(), (lib_attn.recording() if run % 2 else contextlib.nullcontext()) as rec:
                    out = compiled(**kwargs).sample
                if rec is not None:
                    assert rec.calls == {("dit", "sdpa"): 2}
                assert rel_err(out, want) < FP32_BOUND
            assert len(sdpa_ran) == 48 and not math_ran
            with torch.no_grad(), lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
                out = compiled(**kwargs).sample
            assert rec.calls == {("dit", "math"): 2} and len(math_ran) == 2 and len(sdpa_ran) == 48
            assert rel_err(out, want) < FP32_BOUND
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()


# --- schedules on real pipelines --------------------------------------------------------------------

TWO = "0-50%: sdpa; 50-100%: math"


def build_pipeline(name: str, scheduler, img2img: bool = False):
    """Kandinsky 2.2's decoder (UNet with cross-attention to image-embedding tokens, MoVQ) or DiT
    (class-conditional transformer, AutoencoderKL), tiny, random weights."""
    torch.manual_seed(5)
    if name == "kandinsky":
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=8, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32, encoder_hid_dim=16,
            encoder_hid_dim_type="image_proj", addition_embed_type="image").eval()
        movq = VQModel(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), latent_channels=4,
            layers_per_block=1, norm_num_groups=32, num_vq_embeddings=16, vq_embed_dim=4).eval()
        cls = KandinskyV22Img2ImgPipeline if img2img else KandinskyV22Pipeline
        pipe = cls(unet=unet, scheduler=scheduler, movq=movq)
    else:
        transformer = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                            num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000).eval()
        pipe = DiTPipeline(transformer=transformer, vae=build("vae"), scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, steps: int, strength: float | None = None):
    """One image (a tensor in [0, 1]) from fixed seeds."""
    g = torch.Generator().manual_seed(7)
    if isinstance(pipe, DiTPipeline):
        out = pipe(class_labels=[3], num_inference_steps=steps, generator=g, output_type="np").images
        return torch.from_numpy(out)
    embeds = dict(image_embeds=torch.randn(1, 16, generator=g), negative_image_embeds=torch.randn(1, 16, generator=g),
                  height=16, width=16, num_inference_steps=steps, output_type="pt")
    if strength is not None:
        embeds.update(image=torch.rand(1, 3, 16, 16, generator=g), strength=strength)
    return pipe(**embeds, generator=torch.Generator().manual_seed(8)).images


def denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def calls_per_model_call(pipe, steps: int, strength=None) -> tuple:
    """(attention calls per denoiser call, denoiser calls, attention calls outside the denoiser) of an
    unrouted run, counted at PyTorch's SDPA."""
    inside, counts = [False], {"model": 0, "in": 0, "out": 0}

    def starts(*args):
        inside[0] = True
        counts["model"] += 1

    def ends(*args):
        inside[0] = False

    real = F.scaled_dot_product_attention

    def counting(*args, **kw):
        counts["in" if inside[0] else "out"] += 1
        return real(*args, **kw)
    model = denoiser(pipe)
    handles = [model.register_forward_pre_hook(starts), model.register_forward_hook(ends)]
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(F, "scaled_dot_product_attention", counting)
            generate(pipe, steps, strength)
    finally:
        for handle in handles:
            handle.remove()
    assert counts["in"] % counts["model"] == 0
    return counts["in"] // counts["model"], counts["model"], counts["out"]


SCHEDULERS = {
    # name: (pipeline, scheduler, steps, the fraction of steps done at each denoiser call)
    "kandinsky-ddpm": ("kandinsky", lambda: DDPMScheduler(), 6, [i / 6 for i in range(6)]),  # the timestep's position
    "kandinsky-dpm++": ("kandinsky", lambda: DPMSolverMultistepScheduler(), 6, [i / 6 for i in range(6)]),  # step_index
    "dit-euler": ("dit", lambda: EulerDiscreteScheduler(), 4, [0, 0.25, 0.5, 0.75]),  # set by scale_model_input
    "dit-ddim": ("dit", lambda: DDIMScheduler(), 5, [0, 0.2, 0.4, 0.6, 0.8]),
    # order 2: two denoiser calls per step but the last, both counted as the step
    "dit-heun": ("dit", lambda: HeunDiscreteScheduler(), 3, [0, 0, 1 / 3, 1 / 3, 2 / 3]),
    "dit-kdpm2": ("dit", lambda: KDPM2DiscreteScheduler(), 3, [0, 0, 1 / 3, 1 / 3, 2 / 3]),
    # PLMS as SD configures it: one warm-up call more than the steps asked for, its timestep repeated
    "dit-pndm": ("dit", lambda: PNDMScheduler(skip_prk_steps=True), 4, [0, 0.2, 0.4, 0.6, 0.8]),
}


@pytest.mark.parametrize("case", list(SCHEDULERS))
def test_step_windows_on_a_real_pipeline_count_the_steps_and_add_up(case):
    name, make, steps, progress = SCHEDULERS[case]
    pipe = build_pipeline(name, make())
    per_call, model_calls, vae_calls = calls_per_model_call(pipe, steps)
    assert model_calls == len(progress) and per_call > 0 and vae_calls > 0
    role = "unet" if name == "kandinsky" else "dit"
    seen = []
    with route(pipe, schedule=TWO), lib_attn.recording() as rec:
        handle = denoiser(pipe).register_forward_pre_hook(lambda *a: seen.append(sched.position().progress))
        generate(pipe, steps)
        handle.remove()
    assert seen == pytest.approx(progress)
    first = sum(1 for p in progress if p < 0.5)
    text = sched.parse(TWO).text
    assert rec.rules == {(text, "0-50%", role, "sdpa"): first * per_call,
                         (text, "50-100%", role, "math"): (model_calls - first) * per_call,
                         (text, sched.OTHERWISE, "vae", "sdpa"): vae_calls}
    assert sum(rec.rules.values()) == rec.total()
    assert lib_attn.config().schedule is None and sched.position().progress is None  # the scope's schedule and step end with it


@pytest.mark.parametrize("name", ["kandinsky", "dit"])
def test_scheduled_image_equals_the_unscheduled_ones_within_rounding(name):
    pipe = build_pipeline(name, DPMSolverMultistepScheduler())
    own = generate(pipe, 4)
    images = {}
    for chain in ("sdpa", "math"):
        with route(pipe), lib_attn.use(preference=[chain]), lib_attn.recording() as rec:
            images[chain] = generate(pipe, 4)
        assert set(backend for _, backend in rec.calls) == {chain}
    with route(pipe, schedule=TWO), lib_attn.recording() as rec:
        scheduled = generate(pipe, 4)
    assert {backend for *_, backend in rec.rules} == {"sdpa", "math"}
    for want in (own, images["sdpa"], images["math"]):
        assert rel_err(scheduled, want) < FP32_BOUND


def docs_schedule(page: str) -> str:
    """The schedule of the first ``route(pipe, schedule="...")`` example on ``docs/<page>``."""
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", page)
    return re.search(r'route\(pipe, schedule="([^"]+)"\)', open(path, encoding="utf-8").read())[1]


def test_the_diffusers_pages_schedule_runs_cross_attention_on_sdpa_at_every_step():
    text = docs_schedule("diffusers.md")
    assert "cross: sdpa" in text
    pipe = build_pipeline("kandinsky", DDPMScheduler())
    counts = {}
    for schedule in (text, "cross: sdpa"):  # the second: every cross-attention call, and nothing else
        with route(pipe, schedule=schedule), lib_attn.recording() as rec:
            generate(pipe, 5)
        counts[schedule] = {}
        for (t, label, _, backend), n in rec.rules.items():
            if t == sched.parse(schedule).text:
                counts[schedule][label] = counts[schedule].get(label, 0) + n
                assert label != "cross" or backend == "sdpa"
    crosses = counts["cross: sdpa"]["cross"]
    assert crosses > 0 and counts[text]["cross"] == crosses  # every cross-attention call took the cross rule
    assert sum(n for label, n in counts[text].items() if label.endswith("%")) > 0


def test_img2img_strength_counts_the_steps_that_run():
    """Strength 0.5 of 10 steps runs the last 5: the windows are fractions of those 5."""
    for scheduler in (DDPMScheduler(), DPMSolverMultistepScheduler()):
        pipe = build_pipeline("kandinsky", scheduler, img2img=True)
        per_call, model_calls, _ = calls_per_model_call(pipe, 10, strength=0.5)
        assert model_calls == 5
        seen = []
        with route(pipe, schedule="0-40%: sdpa; 40-100%: math"), lib_attn.recording() as rec:
            handle = pipe.unet.register_forward_pre_hook(lambda *a: seen.append(sched.position().progress))
            generate(pipe, 10, strength=0.5)
            handle.remove()
        assert seen == [0.0, 0.2, 0.4, 0.6, 0.8]
        assert rec.rules[("0-40%: sdpa; 40-100%: math", "0-40%", "unet", "sdpa")] == 2 * per_call
        assert rec.rules[("0-40%: sdpa; 40-100%: math", "40-100%", "unet", "math")] == 3 * per_call


def test_a_begin_index_set_by_the_pipeline_starts_the_pass_there():
    """diffusers' SD img2img sets the scheduler's begin index (t_start * order) and loops over the rest of
    its timesteps; here the same calls on Heun (order 2) with DiT's transformer: 6 steps, strength 0.5."""
    pipe = build_pipeline("dit", HeunDiscreteScheduler())
    scheduler, model = pipe.scheduler, pipe.transformer
    seen = []
    with route(pipe, schedule=TWO):
        handle = model.register_forward_pre_hook(lambda *a: seen.append((sched.position().progress, sched.position().sigma)))
        scheduler.set_timesteps(6)
        t_start = 3
        scheduler.set_begin_index(t_start * scheduler.order)
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for t in scheduler.timesteps[t_start * scheduler.order:]:
                x = scheduler.scale_model_input(latents, t)
                out = model(x, timestep=t.expand(1), class_labels=torch.tensor([3])).sample[:, :4]
                latents = scheduler.step(out, t, latents).prev_sample
        handle.remove()
    sigmas = scheduler.sigmas.tolist()
    # steps 3, 4, 5 of 6 are the pass's 0, 1, 2 of 3; the last has no second call
    assert [p for p, _ in seen] == [0.0, 0.0, 1 / 3, 1 / 3, 2 / 3]
    assert [s for _, s in seen] == [sigmas[6], sigmas[6], sigmas[8], sigmas[8], sigmas[10]]


def test_sigma_rule_takes_the_steps_whose_sigma_lies_in_it():
    pipe = build_pipeline("dit", EulerDiscreteScheduler())
    pipe.scheduler.set_timesteps(4)
    sigmas = pipe.scheduler.sigmas.tolist()[:4]
    high = [s for s in sigmas if s >= 2.0]
    assert 0 < len(high) < 4
    per_call, _, _ = calls_per_model_call(pipe, 4)
    text = sched.parse("sigma 2-1000: math").text
    assert text == "sigma 1000-2: math"
    with route(pipe, schedule=text), lib_attn.recording() as rec:
        generate(pipe, 4)
    assert rec.rules[(text, "sigma 1000-2", "dit", "math")] == len(high) * per_call
    assert rec.rules[(text, sched.OTHERWISE, "dit", "sdpa")] == (4 - len(high)) * per_call


def kernel_log(monkeypatch, model, backend_id):
    """A log of which attention module each call of ``backend_id``'s kernel ran in (``model`` is built
    for the test: its hooks stay)."""
    log, current = [], [None]
    names = {m: n for n, m in model.named_modules() if isinstance(m, Attention)}
    for module, name in names.items():
        module.register_forward_pre_hook(lambda m, a, name=name: current.__setitem__(0, name))
    backend = REGISTRY[backend_id]
    real = backend.runner

    def runner(spec):
        kernel = real(spec)

        def run(*args):
            log.append(current[0])
            return kernel(*args)
        return run
    monkeypatch.setattr(backend, "runner", runner)
    lib_attn.reset()
    return log, sorted(names.values())


@pytest.mark.parametrize("rule, takes", [
    ("first 1", lambda n: n.startswith("down_blocks.0.")),   # blocks: down 0, down 1, mid, up 0, up 1
    ("last 1", lambda n: n.startswith("up_blocks.1.")),
    ("blocks 2-2", lambda n: n.startswith("mid_block.")),     # the middle block is one block
    ("cross", lambda n: n.endswith("attn2")),                 # keys from the image-embedding tokens
    ("self", lambda n: n.endswith("attn1")),
    ("first 1 cross", lambda n: n.startswith("down_blocks.0.") and n.endswith("attn2")),
])
def test_block_and_kind_rules_take_the_right_calls(monkeypatch, rule, takes):
    pipe = build_pipeline("kandinsky", DDPMScheduler())
    log, names = kernel_log(monkeypatch, pipe.unet, "math")
    with route(pipe, schedule=f"{rule}: math"), lib_attn.recording() as rec:
        generate(pipe, 2)
    wanted = [n for n in names if takes(n)]
    assert wanted and len(wanted) < len(names)
    assert sorted(set(log)) == wanted and len(log) == 2 * len(wanted)  # 2 steps, every wanted module each
    parsed = sched.parse(f"{rule}: math")
    assert rec.rules[(parsed.text, parsed.rules[0].label, "unet", "math")] == len(log)


def test_a_bad_schedule_is_refused_before_anything_changes():
    pipe = build_pipeline("kandinsky", DDPMScheduler())
    own, config = processor_classes(pipe.unet), lib_attn.config()
    with pytest.raises(lib_attn.ScheduleError, match=r"rule 2 \('50-100%: sage9'\).*sage9.*valid ids"):
        with route(pipe, schedule="0-50%: sdpa; 50-100%: sage9"):
            pass
    with pytest.raises(ValueError, match="pass 'second' is not one of base, hires, refiner"):
        with route(pipe, schedule=TWO, pass_name="second"):
            pass
    assert processor_classes(pipe.unet) == own and lib_attn.config() is config
    assert not pipe.unet._forward_pre_hooks and not any(m._forward_pre_hooks for m in pipe.unet.modules())


def test_a_configured_schedule_is_followed_and_hooks_go_with_the_scope():
    pipe = build_pipeline("dit", EulerDiscreteScheduler())
    per_call, _, _ = calls_per_model_call(pipe, 4)
    with lib_attn.use(schedule=TWO):
        with route(pipe, pass_name="refiner"), lib_attn.recording() as rec:
            generate(pipe, 4)
            assert sched.position().pass_name == "refiner"
        assert lib_attn.config().schedule is not None and sched.position().progress is None
    assert rec.rules[(TWO, "0-50%", "dit", "sdpa")] == 2 * per_call
    assert not any(m._forward_pre_hooks for m in pipe.transformer.modules())
    with lib_attn.use(schedule="refiner: math"), route(pipe, pass_name="base"), lib_attn.recording() as rec:
        generate(pipe, 4)
    assert {(label, backend) for _, label, role, backend in rec.rules if role == "dit"} == {(sched.OTHERWISE, "sdpa")}


@pytest.mark.skipif(_compat.CUSTOM_OP is None, reason="torch.library.custom_op needs torch 2.4")
def test_step_windows_hold_for_a_compiled_denoiser():
    """The step is told by a hook on the denoiser itself, which runs as each compiled call starts; the
    engine's operator decides when the graph runs."""
    torch._dynamo.reset()
    pipe = build_pipeline("dit", EulerDiscreteScheduler())
    per_call, _, vae_calls = calls_per_model_call(pipe, 4)
    want = generate(pipe, 4)
    pipe.transformer.compile()
    try:
        with route(pipe, schedule=TWO), lib_attn.recording() as rec:
            out = generate(pipe, 4)
        assert rec.rules == {(TWO, "0-50%", "dit", "sdpa"): 2 * per_call, (TWO, "50-100%", "dit", "math"): 2 * per_call,
                             (TWO, sched.OTHERWISE, "vae", "sdpa"): vae_calls}
        assert rel_err(out, want) < FP32_BOUND
    finally:
        torch._dynamo.reset()


# --- stand-ins whose role is decided per call (a host that routes by the work running now) ---------

def test_served_stand_ins_take_the_role_of_each_call_and_pass_through_without_one(models, monkeypatch):
    """A module's ``dispatch_attention_fn`` and ``F`` rebound to stand-ins whose role a function gives:
    with a role the model's calls reach the engine under it; with None they run as the model's own,
    bit for bit, and nothing is counted."""
    from diffusers.models.transformers import transformer_flux

    model, kwargs = models["flux"], inputs("flux", torch.float32)
    want = forward(model, kwargs)
    role = {"now": None}
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn",
                        integration.served_dispatch(lambda: role["now"], transformer_flux.dispatch_attention_fn))
    with lib_attn.recording() as rec:
        unrouted = forward(model, kwargs)
        role["now"] = "dit"
        routed = forward(model, kwargs)
        role["now"] = "vae"
        forward(model, kwargs)
    assert torch.equal(unrouted, want)
    assert rel_err(routed, want) < 1e-5
    assert rec.calls == {("dit", "sdpa"): 2, ("vae", "sdpa"): 2}

    functional = integration.served_functional(lambda: role["now"])
    q, k, v = (torch.randn(B, 2, 10, 16, dtype=torch.float64) for _ in range(3))
    role["now"] = None
    with lib_attn.recording() as rec:
        plain = functional.scaled_dot_product_attention(q, k, v)
        role["now"] = "unet"
        served = functional.scaled_dot_product_attention(q, k, v)
        causal = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, k, v)) and rel_err(served, plain) < 1e-12
    assert torch.equal(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert functional.gelu is F.gelu
    assert rec.calls == {("unet", "sdpa"): 1}
    assert rec.fallbacks == {("unet", "lib_attn", "causal mask: ran on PyTorch SDPA"): 1}


def test_served_dispatch_hands_backend_arguments_and_context_parallel_back_to_diffusers(monkeypatch):
    seen = []

    def real(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             attention_kwargs=None, *, backend=None, parallel_config=None):
        seen.append((attention_kwargs, backend, parallel_config))
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value))).transpose(1, 2)

    dispatch = integration.served_dispatch("dit", real)
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    with lib_attn.recording() as rec:
        dispatch(q, k, v)
        dispatch(q, k, v, attention_kwargs={"window_size": 4})
        dispatch(q, k, v, parallel_config=object())
        dispatch(q, k, v, backend="flash")
    assert [s[0] for s in seen] == [{"window_size": 4}, None]
    assert rec.calls == {("dit", "sdpa"): 2}
    assert rec.fallbacks == {("dit", "lib_attn", "backend arguments window_size: ran on diffusers' dispatcher"): 1,
                             ("dit", "lib_attn", "context parallel: ran on diffusers' dispatcher"): 1}


def _layer_skip(scores: bool):
    from diffusers.hooks import LayerSkipConfig

    return LayerSkipConfig(indices=[0], fqn="down_blocks.0.attentions.0.transformer_blocks", skip_attention=not scores,
                           skip_attention_scores=scores, skip_ff=False)


def test_a_layer_skip_set_inside_the_scope_skips_as_it_does_outside():
    # SkipLayerGuidance and AutoGuidance add their hooks at each step, inside the scope: diffusers looks the
    # processor's class up in its registry, which must know the routed class.
    from diffusers.hooks import apply_layer_skip

    model, x = build("unet"), inputs("unet", torch.float32)
    with torch.no_grad():
        plain = model(**x).sample
        apply_layer_skip(model, _layer_skip(False))
        want = model(**x).sample
        build_again = build("unet")
        with route(build_again), lib_attn.recording() as rec:
            apply_layer_skip(build_again, _layer_skip(False))
            out = build_again(**x).sample
    assert rel_err(want, plain) > 1e-3  # the skip changes the output
    assert rel_err(out, want) < FP32_BOUND and sum(rec.calls.values()) > 0


def test_a_guider_skipping_attention_scores_is_refused_naming_it():
    # PerturbedAttentionGuidance catches F.scaled_dot_product_attention as it is called, which a routed
    # processor does not call: refused as the model is called, not run without its perturbation.
    from diffusers.hooks import apply_layer_skip

    model, x = build("unet"), inputs("unet", torch.float32)
    with torch.no_grad(), route(model):
        apply_layer_skip(model, _layer_skip(True))
        with pytest.raises(ValueError) as refused:
            model(**x)
    message = str(refused.value)
    assert message.startswith("lib_attn route() cannot run UNet2DConditionModel")
    assert "(AttentionProcessorSkipHook) on down_blocks.0.attentions.0.transformer_blocks.0.attn1" in message
    assert "PerturbedAttentionGuidance" in message
