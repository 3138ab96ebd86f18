"""The stand-ins at the attention names of InvokeAI's and diffusers' model modules, on the real modules:
InvokeAI 6.14.2's FLUX.1 blocks, diffusers' Qwen-Image transformer (its dispatcher), its VAE (SDPA
called by an autoencoder module), an SD UNet and a VAE through ``AttnProcessor2_0``.

Each routed run is checked against the same model in float64 on PyTorch's own attention, with
bounds tied to the dtype; a call made while no node is routed must be the original call, bit for bit
and uncounted; ``undo`` must put back exactly the objects that were there.
"""
import copy

import pytest
import torch

import lib_attn
from invoke_attn import targets, work

FP32 = dict(rtol=2e-4, atol=2e-5)
FP64 = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def unrouted():
    targets.undo()
    yield
    targets.undo()


def _run_routed(role, fn):
    with work.running(role), lib_attn.recording() as rec:
        out = fn()
    return out, rec


def _flux_blocks(dtype):
    from invokeai.backend.flux.modules import layers

    double = layers.DoubleStreamBlock(64, 4, 2.0, qkv_bias=True).to(dtype)
    single = layers.SingleStreamBlock(64, 4, 2.0).to(dtype)
    embed = layers.EmbedND(dim=16, theta=10000, axes_dim=[4, 6, 6])
    return double, single, embed


def _flux_forward(double, single, embed, img, txt, vec, ids):
    pe = embed(ids)
    img, txt = double(img=img, txt=txt, vec=vec, pe=pe)
    return single(torch.cat((txt, img), dim=1), vec=vec, pe=pe)


@pytest.mark.parametrize("dtype,bounds", [(torch.float32, FP32), (torch.float64, FP64)])
def test_flux1_blocks_run_on_the_engine_as_dit(dtype, bounds):
    from invokeai.backend.flux import math as flux_math
    from invokeai.backend.flux.modules import layers

    double, single, embed = _flux_blocks(dtype)
    img, txt, vec = torch.randn(2, 12, 64, dtype=dtype), torch.randn(2, 5, 64, dtype=dtype), torch.randn(2, 64, dtype=dtype)
    ids = torch.randint(0, 8, (2, 17, 3)).to(torch.float64)
    reference = _flux_forward(copy.deepcopy(double).double(), copy.deepcopy(single).double(), embed,
                              img.double(), txt.double(), vec.double(), ids)

    routed = targets.route()
    assert "invokeai.backend.flux.modules.layers.attention" in routed
    assert "invokeai.backend.flux.math.attention" not in targets.routed()  # the source module stays InvokeAI's

    out, rec = _run_routed("dit", lambda: _flux_forward(double, single, embed, img, txt, vec, ids))
    assert rec.total("dit") == 2 and rec.total() == 2  # one call per block
    torch.testing.assert_close(out.double(), reference, **bounds)

    targets.undo()
    assert layers.attention is flux_math.attention


def test_a_call_while_no_node_is_routed_is_the_original_call():
    double, single, embed = _flux_blocks(torch.float32)
    img, txt, vec = torch.randn(1, 12, 64), torch.randn(1, 5, 64), torch.randn(1, 64)
    ids = torch.randint(0, 8, (1, 17, 3)).to(torch.float64)
    before = _flux_forward(double, single, embed, img, txt, vec, ids)
    targets.route()
    with lib_attn.recording() as rec:
        after = _flux_forward(double, single, embed, img, txt, vec, ids)
    assert torch.equal(before, after)
    assert rec.total() == 0


def _qwen_transformer():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                       num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def _qwen_forward(model, dtype):
    torch.manual_seed(1)
    hidden = torch.randn(1, 16, 16, dtype=dtype)
    text = torch.randn(1, 7, 32, dtype=dtype)
    mask = torch.ones(1, 7, dtype=torch.long)
    return lambda m=model: m(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                             timestep=torch.tensor([0.5], dtype=dtype), img_shapes=[(1, 4, 4)], return_dict=False)[0]


def test_a_diffusers_transformer_reaches_the_engine_through_its_dispatcher():
    import diffusers.models.transformers.transformer_qwenimage as qwen_module
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    # Qwen-Image's float64 path is not its float32 one (its rotary embedding), so the reference is the
    # float32 model on PyTorch's SDPA, and the routed run uses the engine's own math kernel.
    model = _qwen_transformer().eval()
    with torch.no_grad():
        reference = _qwen_forward(model, torch.float32)()
        routed = targets.route()
        assert "diffusers.models.transformers.transformer_qwenimage.dispatch_attention_fn" in routed
        with lib_attn.use(preference=["math"]):
            out, rec = _run_routed("dit", _qwen_forward(model, torch.float32))
    assert dict(rec.calls) == {("dit", "math"): 2}  # one joint attention per block
    torch.testing.assert_close(out, reference, **FP32)
    targets.undo()
    assert qwen_module.dispatch_attention_fn is dispatch_attention_fn


def test_an_autoencoder_module_counts_as_the_vae_whichever_node_runs_it():
    import diffusers.models.autoencoders.autoencoder_kl_qwenimage as vae_module
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False]).eval()
    z = torch.randn(1, 4, 1, 8, 8)
    with torch.no_grad():
        reference = copy.deepcopy(vae).double().decode(z.double()).sample
        assert "diffusers.models.autoencoders.autoencoder_kl_qwenimage.F" in targets.route()
        out, rec = _run_routed("dit", lambda: vae.decode(z).sample)  # e.g. FLUX.2's denoise node encoding a reference
    assert rec.total("vae") >= 1 and rec.total("dit") == 0
    torch.testing.assert_close(out.double(), reference, **FP32)
    targets.undo()
    assert vae_module.F is torch.nn.functional


def test_sd_unet_and_vae_through_attn_processor_take_the_node_role():
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8).eval()
    vae = AutoencoderKL(block_out_channels=(32,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8).eval()
    latents, text = torch.randn(2, 4, 8, 8), torch.randn(2, 6, 32)
    with torch.no_grad():
        unet_ref = copy.deepcopy(unet).double()(latents.double(), 10, text.double()).sample
        vae_ref = copy.deepcopy(vae).double().decode(latents.double()).sample
        targets.route()
        unet_out, unet_rec = _run_routed("unet", lambda: unet(latents, 10, text).sample)
        vae_out, vae_rec = _run_routed("vae", lambda: vae.decode(latents).sample)
    # Four transformer blocks (one down, the mid block, two up), each a self- and a cross-attention; the
    # VAE's mid-block attention.
    assert dict(unet_rec.calls) and set(r for r, _ in unet_rec.calls) == {"unet"} and unet_rec.total() == 8
    assert set(r for r, _ in vae_rec.calls) == {"vae"} and vae_rec.total() == 1
    torch.testing.assert_close(unet_out.double(), unet_ref, **FP32)
    torch.testing.assert_close(vae_out.double(), vae_ref, **FP32)


def test_modules_that_never_call_sdpa_keep_torch_functional():
    import diffusers.models.attention_processor as processors
    import diffusers.models.resnet as resnet

    targets.route()
    assert resnet.F is torch.nn.functional  # activations and interpolation only
    assert processors.F is not torch.nn.functional
    assert processors.F.silu is torch.nn.functional.silu  # everything but SDPA is PyTorch's own


def test_undo_puts_back_exactly_what_was_there():
    import sys

    import diffusers.models.transformers.transformer_qwenimage  # noqa: F401 - a dispatcher module loaded
    from invokeai.backend.flux.modules import layers  # noqa: F401 - FLUX.1's blocks loaded

    def snapshot():
        return {name: dict(vars(module)) for name, module in list(sys.modules.items())
                if name.startswith(targets.PREFIXES) and module is not None}

    before = snapshot()
    assert len(targets.route()) > 5
    changed = [(name, attr) for name, names in snapshot().items() for attr, value in names.items()
               if name in before and before[name].get(attr) is not value]
    assert changed
    assert targets.undo() == len(changed)
    after = snapshot()
    assert all(after[name][attr] is before[name][attr] for name, attr in changed)


SLOW_MODULE = '''
import threading
import torch

started.set()       # the import has begun: its names are not bound yet
proceed.wait(30)    # another thread scans now

import torch.nn.functional as F


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)
'''


def test_a_module_another_thread_is_importing_is_routed_once_imported(tmp_path, monkeypatch):
    """A session on one GPU imports a model module (diffusers imports them lazily when a model loads) while
    a session on another GPU scans: the half-built module is left, and the next scan routes it."""
    import builtins
    import importlib
    import sys
    import threading

    import invokeai.backend as backend

    name = "invokeai.backend.slow_attention_module"
    (tmp_path / "slow_attention_module.py").write_text(SLOW_MODULE)
    monkeypatch.setattr(backend, "__path__", [*backend.__path__, str(tmp_path)])
    started, proceed = threading.Event(), threading.Event()
    monkeypatch.setattr(builtins, "started", started, raising=False)
    monkeypatch.setattr(builtins, "proceed", proceed, raising=False)
    imported = []
    importer = threading.Thread(target=lambda: imported.append(importlib.import_module(name)),
                                name="session_processor_0")
    try:
        importer.start()
        assert started.wait(30)
        scanned = []
        scanner = threading.Thread(target=lambda: scanned.append(targets.route()), name="session_processor_1")
        scanner.start()
        scanner.join(30)
        assert name in sys.modules and not any(w.startswith(name) for w in scanned[0])
        proceed.set()
        importer.join(30)
        assert targets.route() == [f"{name}.F"]
        q = torch.randn(1, 2, 8, 16)
        with work.running("dit"), lib_attn.recording() as rec:
            imported[0].attend(q, q, q)
        assert rec.total("dit") == 1
    finally:
        proceed.set()
        importer.join(30)
        sys.modules.pop(name, None)
