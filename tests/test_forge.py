"""The Forge adapter against the Forge double: by-name rebinding, parity with attention_pytorch, restore."""
import pytest
import torch

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.routing import forge

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def originals():
    import backend.attention as attention
    import backend.nn.chroma as chroma
    import backend.nn.flux as flux
    import backend.nn.t5 as t5
    import backend.nn.unet as unet
    import backend.nn.vae as vae
    return {
        "unet": unet.attention_function, "flux": flux.attention_function, "chroma": chroma.attention_function,
        "vae": vae.attention_function_single_head_spatial, "t5": t5.attention_function,
        "attention.attention_function": attention.attention_function,
        "attention.single_head": attention.attention_function_single_head_spatial,
    }


def start(webui_factory, argv=("--attention-pytorch",)):
    """Forge with SDPA selected (as on a GPU), so the originals are attention_pytorch and its VAE twin."""
    webui = webui_factory("forge", argv=list(argv))
    before = originals()
    webui.load_scripts()
    return webui, before


def test_import_on_forge_raises_nothing_and_patches_by_name(webui_factory, capsys):
    webui, before = start(webui_factory)
    assert "Error" not in capsys.readouterr().err
    with pytest.raises(ImportError):
        from modules.sd_hijack_optimizations import SdOptimization  # noqa: F401
    import webui_attn.routing.a1111  # noqa: F401  (importable on Forge too)
    after = originals()
    for name in ("unet", "flux", "chroma", "vae"):
        assert after[name] is not before[name], name
    for name in ("t5", "attention.attention_function", "attention.single_head"):
        assert after[name] is before[name], name
    import backend.attention as attention
    assert after["t5"] is attention.attention_pytorch


@pytest.mark.parametrize("argv", [["--attention-pytorch"], []])   # SDPA, and CPU's sub-quadratic default
def test_memory_required_is_unchanged(webui_factory, argv):
    webui = webui_factory("forge", argv=argv)
    from backend.modules.k_model import KModel
    model = KModel(torch.float16)
    shapes = [(2, 4, 64, 64), (1, 16, 128, 128)]
    estimate = [model.memory_required(s) for s in shapes]
    webui.load_scripts()
    assert forge.line.router.patches.active
    assert [model.memory_required(s) for s in shapes] == estimate


def test_unpatching_restores_every_original_and_apply_twice_is_harmless(webui_factory):
    webui, before = start(webui_factory)
    patched = originals()
    assert forge.apply() == forge.line.router.patches.targets()       # again: nothing changes
    assert originals() == patched
    from modules import script_callbacks
    script_callbacks.script_unloaded_callback()
    after = originals()
    assert all(after[n] is before[n] for n in before)
    assert forge.uninstall() == 0                          # safe twice
    webui.load_scripts()                                   # "Reload UI": patched again, once
    assert originals()["unet"] is not before["unet"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d,n,m", [(8, 40, 64, 77), (8, 160, 16, 16), (10, 64, 64, 77)])
def test_unet_function_matches_attention_pytorch(webui_factory, dtype, heads, d, n, m):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.unet as unet
    q = torch.randn(2, n, heads * d, dtype=torch.float64)
    k, v = torch.randn(2, m, heads * d, dtype=torch.float64), torch.randn(2, m, heads * d, dtype=torch.float64)
    ref = attention.attention_pytorch(q, k, v, heads)
    with lib_attn.recording() as rec:
        out = unet.attention_function(q.to(dtype), k.to(dtype), v.to(dtype), heads)
    assert out.shape == (2, n, heads * d) and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]
    assert sum(rec.calls.values()) == 1 and all(role == "unet" for role, _ in rec.calls)


@pytest.mark.parametrize("kind", ["additive-2d", "additive-3d", "additive-4d", "bool-2d"])
def test_masks_are_passed_on(webui_factory, kind):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.unet as unet
    heads, d, n, m = 4, 32, 24, 40
    q = torch.randn(1, n, heads * d, dtype=torch.float64)
    k, v = torch.randn(1, m, heads * d, dtype=torch.float64), torch.randn(1, m, heads * d, dtype=torch.float64)
    if kind.startswith("bool"):
        mask = torch.rand(n, m) > 0.3
        mask[:, 0] = True
    else:
        shape = {"additive-2d": (n, m), "additive-3d": (1, n, m), "additive-4d": (1, heads, n, m)}[kind]
        mask = torch.randn(shape, dtype=torch.float64) * 3
    ref = attention.attention_pytorch(q, k, v, heads, mask)
    unmasked = attention.attention_pytorch(q, k, v, heads)
    with lib_attn.recording() as rec:
        out = unet.attention_function(q.float(), k.float(), v.float(), heads, mask if mask.dtype == torch.bool else mask.float())
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert rel_err(ref, unmasked) > 1e-2                 # the mask mattered
    assert all(role == "unet" for role, _ in rec.calls)


def flux_inputs(dtype, hidden=128, heads=4, l_txt=8, l_img=16):
    from backend.nn.flux import EmbedND
    torch.manual_seed(0)
    img = torch.randn(1, l_img, hidden, dtype=dtype)
    txt = torch.randn(1, l_txt, hidden, dtype=dtype)
    ids = torch.cat([torch.zeros(1, l_txt, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(4.0), torch.arange(l_img / 4), indexing="ij"), -1).reshape(1, l_img, 3)], dim=1)
    pe = EmbedND(hidden // heads, 10000, [8, 12, 12])(ids)
    return img, txt, pe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_blocks_go_through_the_engine_and_match(webui_factory, dtype):
    webui, before = start(webui_factory)
    import backend.nn.flux as flux
    hidden, heads = 128, 4
    double = flux.DoubleStreamBlock(hidden, heads).double()
    single = flux.SingleStreamBlock(hidden, heads).double()
    img, txt, pe = flux_inputs(torch.float64, hidden, heads)
    q, _, v = double.img_attn.qkv_views(img)
    assert not v.is_contiguous() and v.stride(-1) == 1        # Flux's strided views reach the function

    patched = flux.attention_function
    flux.attention_function = before["flux"]                   # reference: the attention_pytorch path, fp64
    try:
        ref_img, ref_txt = double(img, txt, pe)
        ref_single = single(torch.cat((ref_txt, ref_img), 1), pe)
    finally:
        flux.attention_function = patched

    double.to(dtype)
    single.to(dtype)
    with lib_attn.recording() as rec:
        out_img, out_txt = double(img.to(dtype), txt.to(dtype), pe)
        out_single = single(torch.cat((ref_txt, ref_img), 1).to(dtype), pe)
    assert rec.calls and all(role == "dit" for role, _ in rec.calls) and sum(rec.calls.values()) == 2
    assert out_img.dtype == dtype and out_single.shape == ref_single.shape
    for out, ref in ((out_img, ref_img), (out_txt, ref_txt), (out_single, ref_single)):
        assert rel_err(out, ref) <= TOL[dtype]


def test_flux_function_takes_non_contiguous_views_directly(webui_factory):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.flux as flux
    qkv = torch.randn(2, 40, 3, 6, 64, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref = attention.attention_pytorch(q, k, v, 6, skip_reshape=True)
    out = flux.attention_function(q.float(), k.float(), v.float(), q.shape[1], skip_reshape=True)
    assert out.shape == (2, 40, 6 * 64)
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vae_block_goes_through_the_engine_and_matches(webui_factory, dtype):
    webui, before = start(webui_factory)
    import backend.attention as attention
    import backend.nn.vae as vae
    block = vae.AttnBlock(512)
    h = torch.randn(1, 512, 8, 8, dtype=torch.float64)
    q, k, v = block.double().q(h), block.k(h), block.v(h)
    ref = attention.pytorch_attention_single_head_spatial(q, k, v)
    with lib_attn.recording() as rec:
        out = vae.attention_function_single_head_spatial(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.shape == (1, 512, 8, 8) and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]
    assert set(rec.calls) and all(role == "vae" for role, _ in rec.calls)
    with lib_attn.recording() as rec:
        block.to(dtype)(h.to(dtype))
    assert sum(n for (role, _), n in rec.calls.items() if role == "vae") == 1


def test_t5_still_calls_attention_pytorch(webui_factory, monkeypatch):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.t5 as t5
    assert t5.attention_function is attention.attention_pytorch
    calls = []
    real = t5.attention_function
    monkeypatch.setattr(t5, "attention_function", lambda *a, **kw: calls.append(a[4].shape) or real(*a, **kw))
    layer = t5.T5Attention(64, 64, 4)
    with lib_attn.recording() as rec:
        out, bias = layer(torch.randn(1, 12, 64))
    assert calls == [torch.Size([1, 4, 12, 12])]              # with its relative-position mask
    assert not rec.calls


def spy_engine(monkeypatch):
    seen = []
    real = lib_attn.attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, kwargs.get("fp32")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(lib_attn, "attention", spy)
    return seen


@pytest.mark.parametrize("argv,attn_precision,expected", [
    ([], None, (torch.bfloat16, None)),
    ([], torch.float32, (torch.float32, "keep")),
    (["--force-upcast-attention"], None, (torch.float32, "keep")),
    (["--disable-attention-upcast"], torch.float32, (torch.bfloat16, None)),
    (["--force-upcast-attention", "--attn-fp32", "cast"], None, (torch.float32, None)),
])
def test_precision_follows_forge(webui_factory, monkeypatch, argv, attn_precision, expected):
    start(webui_factory, ["--attention-pytorch", *argv])
    import backend.nn.unet as unet
    seen = spy_engine(monkeypatch)
    q = torch.randn(1, 16, 128, dtype=torch.bfloat16)
    out = unet.attention_function(q, q, q, 4, attn_precision=attn_precision)
    assert seen == [expected] and out.dtype == torch.bfloat16


def test_flags_are_read_from_shared_cmd_opts(webui_factory):
    start(webui_factory, ["--attention-pytorch", "--attn-backend", "sdpa-math"])
    import backend.args
    from modules import shared
    assert shared.cmd_opts.attn_backend == "sdpa-math"
    assert not hasattr(backend.args.args, "attn_backend")      # Forge's own args never see them
    import backend.nn.unet as unet
    q = torch.randn(1, 16, 128)
    with lib_attn.recording() as rec:
        unet.attention_function(q, q, q, 4)
    assert set(rec.calls) == {("unet", "sdpa-math")}


def test_sd3_mmditx_calls_go_through_the_engine_and_match(webui_factory):
    """SD3 / SD3.5 (``backend.nn.mmditx``) calls its own ``attention``: routed as the DiT, the blocks'
    outputs (joint attention, and SD3.5 Medium's second self-attention) match Forge's own."""
    webui = webui_factory("forge", argv=["--attention-pytorch"])
    import backend.nn.mmditx as mmditx
    own = mmditx.attention
    torch.manual_seed(0)
    model = mmditx.MMDiTX(hidden_size=64, num_heads=4, depth=2, context_dim=32, x_block_self_attn_layers=(0,)).double()
    x, c, ctx = torch.randn(1, 16, 64, dtype=torch.float64), torch.randn(1, 64, dtype=torch.float64), \
        torch.randn(1, 6, 32, dtype=torch.float64)
    ref = model(x, c, ctx)
    webui.load_scripts()
    assert mmditx.attention is not own and "backend.nn.mmditx.attention" in forge.line.router.patches.targets()
    with lib_attn.recording() as rec:
        out = model.float()(x.float(), c.float(), ctx.float())
    assert rec.calls == {("dit", "sdpa"): 3}              # two joint calls, one x-block self-attention
    assert rel_err(out, ref) <= TOL[torch.float32]
    forge.uninstall()
    assert mmditx.attention is own


def test_another_extensions_function_is_left_alone_and_named(webui_factory, capsys):
    webui = webui_factory("forge", argv=["--attention-pytorch"])
    import backend.nn.mmditx as mmditx

    def theirs(q, k, v, heads, mask=None):
        return q

    mmditx.attention = theirs
    webui.load_scripts()
    assert mmditx.attention is theirs
    out = capsys.readouterr().out
    assert "left on the host's own attention: backend.nn.mmditx.attention (holds" in out and "theirs" in out
