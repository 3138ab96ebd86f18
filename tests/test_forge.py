"""The Forge adapter against the Forge double: by-name rebinding, parity with attention_pytorch, restore."""
import sys

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
    for name in ("t5", "attention.single_head"):
        assert after[name] is before[name], name
    import backend.attention as attention
    assert after["t5"] is attention.attention_pytorch
    # the host's own global holds the engine's function, equal to the one Forge chose
    assert after["attention.attention_function"] is not before["attention.attention_function"]
    assert after["attention.attention_function"] == before["attention.attention_function"]
    assert after["attention.attention_function"] != attention.attention_split


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


def test_builtin_extensions_and_forges_attention_processor_go_through_the_engine(webui_factory):
    """IP-Adapter, SAG, StyleAlign and reference-only call ``attention.attention_function`` at call time,
    as does ``AttentionProcessorForge``: their calls are counted, and match Forge's own."""
    import types
    start(webui_factory)
    import backend.attention as attention
    heads, d = 4, 16
    q, k, v = (torch.randn(1, 12, heads * d, dtype=torch.float64) for _ in range(3))
    ref = attention.attention_pytorch(q, k, v, heads)
    with lib_attn.recording() as rec:
        out = attention.attention_function(q.float(), k.float(), v.float(), heads=heads, mask=None)
    assert rel_err(out, ref) <= TOL[torch.float32] and rec.calls == {("unet", "sdpa"): 1}
    dim = heads * d
    attn = types.SimpleNamespace(to_q=torch.nn.Linear(dim, dim), to_k=torch.nn.Linear(dim, dim),
                                 to_v=torch.nn.Linear(dim, dim), to_out=[torch.nn.Linear(dim, dim), torch.nn.Identity()],
                                 heads=heads, residual_connection=False, rescale_output_factor=1.0)
    with lib_attn.recording() as rec:
        attention.AttentionProcessorForge()(attn, torch.randn(1, 12, dim))
    assert rec.calls == {("unet", "sdpa"): 1}


COPYING_EXTENSION = (
    "from backend.attention import attention_function as optimized_attention\n"
    "from backend.attention import attention_function\n"
    "def call(q, heads):\n"
    "    return optimized_attention(q, q, q, heads), attention_function(q, q, q, heads)\n")


@pytest.mark.parametrize("mode", ["forge", "neo"])
def test_by_name_copies_in_modules_loaded_before_and_after_are_routed(webui_factory, tmp_path, monkeypatch, mode):
    """An extension that copied the host's function by name before this one loaded (negpip's path on
    Neo, the guidance extensions' on Forge) is routed and put back on unload; one loaded after binds
    the routed function itself."""
    import importlib
    for name in ("copies_early", "copies_late"):
        (tmp_path / f"{name}.py").write_text(COPYING_EXTENSION)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "script_copy.py").write_text(COPYING_EXTENSION)
    webui = webui_factory(mode, argv=["--attention-pytorch"])
    early = importlib.import_module("copies_early")
    own = early.optimized_attention
    from modules import script_loading
    script = script_loading.load_module(str(tmp_path / "script_copy.py"))   # an extension's script, by path
    webui.load_scripts()
    late = importlib.import_module("copies_late")
    targets = forge.line.router.patches.targets()
    assert "copies_early.optimized_attention" in targets and "copies_early.attention_function" in targets
    assert "script_copy.py.optimized_attention" in targets
    q = torch.randn(1, 8, 32)
    with lib_attn.recording() as rec:
        early.call(q, 2)
        late.call(q, 2)
        script.call(q, 2)
    assert rec.calls == {("unet", "sdpa"): 6}
    forge.uninstall()
    assert early.optimized_attention is own and early.attention_function is own
    assert script.optimized_attention is own and script.attention_function is own
    for name in ("copies_early", "copies_late"):
        sys.modules.pop(name, None)
