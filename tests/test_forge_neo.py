"""Forge Neo (the neo line, ComfyUI's function form) against its double: every model family's calls
reach the engine with Neo's keyword arguments, outputs match Neo's own attention in fp32, the
precision rule is called as Neo defines it (and Neo's own defect in it never fails a generation),
blocks that store their function are reached and restored, and undo is exact."""
import pytest
import torch

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from tests.engine_helpers import sage_on_cpu, sage_package  # noqa: F401
from webui_attn.routing import detect, forge
from host_attn import voice
from webui_attn.settings import layers
from webui_attn.ui import api

FP32 = 1e-5


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each test sees the extension's once-per-process lines as a fresh start would."""
    monkeypatch.setattr(voice, "_said", set())


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bindings():
    import backend.attention as attention
    import backend.nn.flux as flux
    import backend.nn.llm.llama as llama
    import backend.nn.lumina as lumina
    import backend.nn.qwen as qwen
    import backend.nn.t5 as t5
    import backend.nn.unet as unet
    import backend.nn.vae as vae
    import backend.nn.wan as wan
    import backend.nn.wan_vae as wan_vae
    return {
        "attention.attention_function": attention.attention_function, "unet": unet.attention_function,
        "flux": flux.attention_function, "wan": wan.optimized_attention, "qwen": qwen.attention_function,
        "lumina": lumina.attention_function, "vae": vae.attention_function_single_head_spatial,
        "wan_vae.vae_attention": wan_vae.vae_attention, "t5": t5.attention_function, "llama": llama.attention_function,
        "wan_vae.AttentionBlock": wan_vae.AttentionBlock.__dict__.get("optimized_attention"),
    }


def start(webui_factory, argv=("--attention-pytorch",)):
    """Neo started as its CPU recipe says (SDPA chosen), the model modules imported as Neo's loader does."""
    webui = webui_factory("neo", argv=list(argv))
    before = bindings()
    webui.load_scripts()
    return webui, before


def test_recognised_as_neo_and_every_family_routed(webui_factory, capsys):
    webui, before = start(webui_factory)
    assert detect.detect() == detect.NEO
    after = bindings()
    for name in ("attention.attention_function", "unet", "flux", "wan", "qwen", "lumina", "vae"):
        assert after[name] is not before[name], name
    assert after["wan_vae.AttentionBlock"] is not None                     # the blocks' descriptor
    for name in ("t5", "llama", "wan_vae.vae_attention"):                  # text encoders keep Neo's
        assert after[name] is before[name], name
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(f"{voice.PREFIX} Forge Neo: attention routed"))
    for target in ("backend.nn.unet.attention_function", "backend.nn.flux.attention_function",
                   "backend.nn.wan.optimized_attention", "backend.nn.qwen.attention_function",
                   "backend.nn.lumina.attention_function", "backend.nn.vae.attention_function_single_head_spatial",
                   "backend.nn.wan_vae.AttentionBlock.optimized_attention"):
        assert target in line, target
    assert "not recognised" not in out


def test_flux_call_with_transformer_options_matches_neo(webui_factory):
    """The call that raised TypeError before: skip_reshape, mask= and transformer_options= keywords."""
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.flux as flux
    qkv = torch.randn(2, 40, 3, 6, 64, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    ref = attention.attention_pytorch(q, k, v, 6, skip_reshape=True)
    with lib_attn.recording() as rec:
        out = flux.attention(q.float(), k.float(), v.float(), None, transformer_options={"cond_or_uncond": [0]})
    assert out.shape == (2, 40, 6 * 64) and rel_err(out, ref) <= FP32
    assert rec.calls == {("dit", "sdpa"): 1}


def test_flux_and_chroma_blocks_match_neo(webui_factory):
    webui, before = start(webui_factory)
    import backend.nn.chroma as chroma
    import backend.nn.flux as flux
    hidden, heads, l_txt, l_img = 96, 4, 6, 12
    double = flux.DoubleStreamBlock(hidden, heads).double()
    single = chroma.ChromaSingleStreamBlock(hidden, heads).double()
    img, txt = torch.randn(1, l_img, hidden, dtype=torch.float64), torch.randn(1, l_txt, hidden, dtype=torch.float64)
    ids = torch.stack([torch.zeros(l_txt + l_img), torch.arange(l_txt + l_img, dtype=torch.float64),
                       torch.zeros(l_txt + l_img)], -1)[None]
    pe = flux.EmbedND(hidden // heads, 10000, [8, 8, 8])(ids)
    mask = torch.zeros(1, 1, l_txt + l_img, l_txt + l_img, dtype=torch.float64)
    mask[..., l_txt - 2:l_txt] = float("-inf")                              # Chroma masks padded text tokens
    patched = flux.attention_function
    flux.attention_function = before["flux"]
    try:
        ref = double(img, txt, pe)
        ref_single = single(torch.cat((txt, img), 1), pe, attn_mask=mask, transformer_options={})
    finally:
        flux.attention_function = patched
    double.float()
    single.float()
    with lib_attn.recording() as rec:
        out = double(img.float(), txt.float(), pe)
        out_single = single(torch.cat((txt, img), 1).float(), pe, attn_mask=mask.float(), transformer_options={})
    assert sum(rec.calls.values()) == 2 and all(role == "dit" for role, _ in rec.calls)
    for o, r in ((out[0], ref[0]), (out[1], ref[1]), (out_single, ref_single)):
        assert rel_err(o, r) <= FP32


def test_unet_call_survives_neos_precision_defect(webui_factory, capsys, monkeypatch):
    """Neo's get_attn_precision raises AttributeError (its parser lacks dont_upcast_attention): the call
    runs at the requested precision, and that is said once."""
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.unet as unet
    with pytest.raises(AttributeError):
        attention.get_attn_precision(None, torch.float16)                  # Neo's own defect
    layer = unet.CrossAttention(64, context_dim=32, heads=4, dim_head=16).double()
    x, ctx = torch.randn(2, 24, 64, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    patched = unet.attention_function
    unet.attention_function = attention.attention_pytorch
    try:
        ref = layer(x, ctx)
    finally:
        unet.attention_function = patched
    layer.float()
    with lib_attn.recording() as rec:
        for _ in range(3):
            out = layer(x.float(), ctx.float())
    assert rel_err(out, ref) <= FP32 and rec.calls == {("unet", "sdpa"): 3}
    lines = [x for x in capsys.readouterr().out.splitlines() if "get_attn_precision failed" in x]
    assert len(lines) == 1 and "Forge Neo" in lines[0] and "AttributeError" in lines[0]


def test_precision_rule_gets_the_inputs_dtype(webui_factory, monkeypatch):
    """Neo's rule is (requested, current_dtype): with --force-upcast-attention fp16 runs in fp32."""
    start(webui_factory)
    import backend.attention as attention
    from host_attn import convention
    seen = []
    monkeypatch.setattr(attention, "args", type("A", (), {"dont_upcast_attention": False})())
    rule = convention.PrecisionRule(attention.get_attn_precision, "Forge Neo")
    assert rule.takes_dtype
    monkeypatch.setattr(attention, "FORCE_UPCAST_ATTENTION_DTYPE", {torch.float16: torch.float32})
    seen.append(rule(None, torch.float16))
    seen.append(rule(None, torch.bfloat16))
    assert seen == [torch.float32, None]


@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_wan_calls_with_heads_as_keyword_and_match(webui_factory, skip_output_reshape):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.wan as wan
    layer = wan.WanSelfAttention(64, 4).double()
    x, freqs = torch.randn(1, 10, 64, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    patched = wan.optimized_attention
    wan.optimized_attention = attention.attention_pytorch
    try:
        ref = layer(x, freqs)
    finally:
        wan.optimized_attention = patched
    with lib_attn.recording() as rec:
        out = layer.float()(x.float(), freqs.float())
    assert rel_err(out, ref) <= FP32 and rec.calls == {("dit", "sdpa"): 1}
    q = torch.randn(1, 10, 64)
    direct = wan.optimized_attention(q, q, q, heads=4, skip_output_reshape=skip_output_reshape)
    want = attention.attention_pytorch(q.double(), q.double(), q.double(), heads=4, skip_output_reshape=skip_output_reshape)
    assert direct.shape == want.shape and rel_err(direct, want) <= FP32


@pytest.mark.parametrize("kind", ["none", "additive-2d", "additive-3d", "additive-4d", "bool-4d"])
def test_qwen_and_lumina_masks_match_neo(webui_factory, kind):
    start(webui_factory)
    import backend.attention as attention
    import backend.nn.lumina as lumina
    import backend.nn.qwen as qwen
    heads, d, n = 4, 16, 20
    mask = None
    if kind == "bool-4d":
        mask = torch.rand(1, 1, n, n) > 0.3
        mask[..., 0] = True
    elif kind != "none":
        mask = torch.randn({"additive-2d": (n, n), "additive-3d": (1, n, n), "additive-4d": (1, heads, n, n)}[kind],
                           dtype=torch.float64) * 3
    q, k, v = (torch.randn(2, n, heads * d, dtype=torch.float64) for _ in range(3))
    ref = attention.attention_pytorch(q, k, v, heads, mask)
    bq, bk, bv = (t.view(2, n, heads, d).transpose(1, 2) for t in (q, k, v))
    ref_lumina = attention.attention_pytorch(bq, bk, bv, heads, mask, skip_reshape=True)
    f = (lambda m: m if m is None or m.dtype == torch.bool else m.float())(mask)
    with lib_attn.recording() as rec:
        out = qwen.attention_function(q.float(), k.float(), v.float(), heads, f)
        out_lumina = lumina.attention_function(bq.float(), bk.float(), bv.float(), heads, f, skip_reshape=True,
                                               transformer_options={})
    assert rel_err(out, ref) <= FP32 and rel_err(out_lumina, ref_lumina) <= FP32
    assert sum(rec.calls.values()) == 2 and all(role == "dit" for role, _ in rec.calls)


def test_wan_vae_blocks_built_before_and_after_are_reached_and_restored(webui_factory):
    webui = webui_factory("neo", argv=["--attention-pytorch"])
    import backend.attention as attention
    import backend.nn.wan_vae as wan_vae
    early = wan_vae.AttentionBlock(32).double()                              # built before the extension loads
    own = early.optimized_attention
    assert own is attention.attention_function_single_head_spatial
    x = torch.randn(1, 32, 2, 4, 4, dtype=torch.float64)
    ref = early(x)
    webui.load_scripts()
    late = wan_vae.AttentionBlock(32).double()
    late.load_state_dict(early.state_dict())
    with lib_attn.recording() as rec:
        out_early, out_late = early.float()(x.float()), late.float()(x.float())
    assert rec.calls == {("vae", "sdpa"): 2}                                 # one call per block (frames in the batch)
    assert rel_err(out_early, ref) <= FP32 and rel_err(out_late, ref) <= FP32
    assert early.optimized_attention is not own
    forge.uninstall()
    assert early.optimized_attention is own and late.optimized_attention is own
    assert "optimized_attention" not in wan_vae.AttentionBlock.__dict__


def test_undo_is_exact_and_reload_routes_again(webui_factory):
    webui, before = start(webui_factory)
    from modules import script_callbacks
    script_callbacks.script_unloaded_callback()
    after = bindings()
    assert all(after[name] is before[name] for name in before)
    webui.load_scripts()
    assert bindings()["flux"] is not before["flux"]


def test_memory_estimate_is_unchanged(webui_factory):
    webui = webui_factory("neo", argv=["--attention-pytorch"])
    from backend.modules.k_model import KModel
    model = KModel(torch.float16)
    shapes = [(2, 4, 64, 64), (1, 16, 128, 128)]
    estimate = [model.memory_required(s) for s in shapes]
    webui.load_scripts()
    assert [model.memory_required(s) for s in shapes] == estimate


@pytest.mark.parametrize("argv,sage,preference,avoid,note", [
    # Neo runs SageAttention whenever it imports (its --sage only installs it)
    ([], "1.0.6", ("sage",), (),
     "Forge Neo chooses sage on an NVIDIA GPU (sageattention 1.0.6 imports): UNet/DiT attention prefers sage in "
     "this extension"),
    (["--sage"], None, None, (), None),
    (["--disable-sage"], "1.0.6", None, ("sage",), "Forge Neo --disable-sage: sage is left out"),
    (["--attention-pytorch"], None, None, ("xformers",), "Forge Neo --attention-pytorch: xformers is left out"),
    # with SageAttention 2, the kernel --sage2-function names takes sage's place
    (["--sage2-function", "fp16_cuda"], "2.2.0", ("sage-cuda",), (),
     "Forge Neo chooses sage-cuda on an NVIDIA GPU (sageattention 2.2.0 imports, --sage2-function fp16_cuda): "
     "UNet/DiT attention prefers sage-cuda"),
    # with 1.x Neo ignores it and runs sageattn: so does the extension, and the line says so
    (["--sage", "--sage2-function", "fp16_cuda"], "1.0.6", ("sage",), (),
     "Forge Neo chooses sage on an NVIDIA GPU (sageattention 1.0.6 imports; --sage2-function fp16_cuda applies to "
     "SageAttention 2 only, so the host runs sageattn): UNet/DiT attention prefers sage"),
    (["--sage2-function", "fp16_triton", "--disable-sage"], "2.2.0", None, ("sage",),
     "Forge Neo --disable-sage: sage is left out"),
    (["--sage2-function", "auto"], "2.2.0", ("sage",), (),
     "Forge Neo chooses sage on an NVIDIA GPU (sageattention 2.2.0 imports)"),
])
def test_neos_own_choice_is_a_preference(sage_package, webui_factory, capsys, argv, sage, preference, avoid, note):
    if sage:
        sage_package(sage)
    start(webui_factory, argv)
    config = lib_attn.config()
    assert config.preference["unet"] == preference and config.preference["dit"] == preference
    assert config.preference["vae"] is None
    assert config.avoid == avoid
    lines = capsys.readouterr().out.splitlines()
    if note is None:
        assert not any(line.startswith(f"{voice.PREFIX} Forge Neo ") and "routed" not in line for line in lines)
    else:
        assert any(line.startswith(f"{voice.PREFIX} {note}") for line in lines), lines


def test_neos_later_sage_function_flag_and_its_values_are_read_by_value(monkeypatch):
    import enum
    import sys
    from types import SimpleNamespace
    from webui_attn.settings import flags

    class Later(enum.Enum):  # a later Neo names the flag --sage-function and adds fp8_cuda++ and sageattn3
        pp = "fp8_cuda++"
        three = "sageattn3"

    monkeypatch.setitem(sys.modules, "backend.memory_management", SimpleNamespace(SAGE_IS_AVAILABLE=True))
    monkeypatch.setattr(flags, "_package_version", lambda package: "2.2.1")
    for value, backend in (("fp8_cuda++", "sage-fp8pp"), ("sageattn3", "sage3")):
        given = flags.host_flags_given("neo", [SimpleNamespace(sage_function=Later(value))])
        chosen = flags.host_choices("neo", given)
        assert flags.host_layer(given, chosen) == {"preference": {"unet": [backend], "dit": [backend]}}, value
    assert all(b in lib_attn.BACKEND_IDS for b in flags.NEO_SAGE_FUNCTIONS.values())


def test_our_flag_wins_over_neos_choice_and_says_what_it_displaced(sage_package, webui_factory, capsys):
    sage_package("1.0.6")
    start(webui_factory, ["--attn-backend", "sdpa-math"])
    assert lib_attn.config().preference["unet"] == ("sdpa-math",)
    assert layers.get_layer("host") == {"preference": {"unet": ["sage"], "dit": ["sage"]}}
    line = next(x for x in capsys.readouterr().out.splitlines() if "Forge Neo chooses sage" in x)
    assert line.endswith("this extension's flags put sdpa-math first instead")


def test_neos_sage_that_cannot_run_here_falls_back_per_call_with_the_reason(sage_package, webui_factory):
    sage_package("1.0.6")
    start(webui_factory, ["--attention-pytorch"])
    import backend.nn.unet as unet
    sage = {b.id: b for b in lib_attn.backends()}["sage"]
    assert not sage.available                                   # no CUDA here
    q = torch.randn(1, 16, 64)
    with lib_attn.recording() as rec:
        unet.attention_function(q, q, q, 4)
    assert rec.calls == {("unet", "sdpa"): 1}
    assert rec.fallbacks == {("unet", "sage", f"not available: {sage.reason}"): 1}


def test_qwen_under_neos_sage_runs_exact(sage_package, webui_factory, sage_on_cpu):
    """Neo with SageAttention installed and --sage: the Qwen-Image call still runs exact, the reason counted."""
    from lib_attn.kernels.base import EXACT_ASKED
    sage_package("1.0.6")
    start(webui_factory, ["--attention-pytorch", "--sage"])
    import backend.nn.qwen as qwen
    q = torch.randn(1, 12, 64)
    with lib_attn.recording() as rec:
        qwen.attention_function(q, q, q, 4)
    assert rec.calls == {("dit", "sdpa"): 1} and rec.fallbacks == {("dit", "sage", EXACT_ASKED): 1}


def test_a_generation_says_sage_is_neos_choice(sage_package, webui_factory):
    """The readout and infotext of a generation name Neo's own kernel and what the extension did."""
    from webui_attn.ui import panel
    from webui_attn.ui.readout import INFOTEXT_NOTE_KEY
    sage_package("1.0.6")
    start(webui_factory, ["--attention-pytorch"])
    from modules import processing
    p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    panel.process(p, "use setting")
    note = p.extra_generation_params[INFOTEXT_NOTE_KEY]()
    assert note == "sage first as Forge Neo's own choice on an NVIDIA GPU (sageattention 1.0.6 imports)"
    panel.postprocess(p, processing.Processed(p, []), "use setting")
    panel.reset()
    p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    panel.process(p, "math")
    assert p.extra_generation_params[INFOTEXT_NOTE_KEY]() == (
        "Forge Neo's own choice sage on an NVIDIA GPU (sageattention 1.0.6 imports) set aside: math first")
    panel.reset()


def test_the_order_in_force_shows_the_hosts_flag(sage_package, webui_factory):
    """Settings and the status route show the chain the host's flag put in force beside Auto's."""
    from webui_attn.ui import components
    sage_package("2.2.0")
    start(webui_factory, ["--sage2-function", "fp16_cuda"])
    data = api.availability()
    assert data["chains"]["unet"][0] == "sage-cuda" and "sage-cuda" not in data["default_chains"]["unet"]
    assert data["chains"]["vae"] == data["default_chains"]["vae"]
    html = components.availability_html(data)
    assert "Default order on this device (Auto)" in html
    assert "Order in force" in html and "sage-cuda → " in html


def test_without_a_kernel_flag_only_the_default_order_is_shown(webui_factory):
    from webui_attn.settings import stored
    from webui_attn.ui import components
    start(webui_factory, [])
    data = api.availability()
    assert data["chains"] == data["default_chains"]
    assert "Order in force" not in components.availability_html(data)


@pytest.mark.parametrize("argv", [["--attention-pytorch", "--attn-backend", "sage"]])
def test_qwen_and_nunchaku_qwen_stay_exact_as_neo_keeps_them(webui_factory, sage_on_cpu, argv):
    """Neo binds PyTorch's attention for Qwen-Image (and Nunchaku's Qwen) whatever it chose: with sage
    first, their calls still run on an exact kernel, the reason counted; the UNet's take sage."""
    from lib_attn.kernels.base import EXACT_ASKED
    start(webui_factory, argv)
    import backend.nn.qwen as qwen
    import backend.nn.unet as unet
    q = torch.randn(1, 12, 64)
    with lib_attn.recording() as rec:
        qwen.attention_function(q, q, q, 4)
        unet.attention_function(q, q, q, 4)
    assert rec.calls == {("dit", "sdpa"): 1, ("unet", "sage"): 1}
    assert rec.fallbacks == {("dit", "sage", EXACT_ASKED): 1}
    assert forge.line.router.patches.is_patched(qwen, "attention_function")
