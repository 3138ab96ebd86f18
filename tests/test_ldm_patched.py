"""reForge and Forge Classic (the ldm_patched line) against their doubles: recognised by their
functions' form, every by-name copy of the chosen function routed (loaded before the extension, or
after), outputs equal to the host's own SDPA function in fp32, the VAE blocks reached and restored,
text encoders left alone, the host's flags honoured, and undo exact."""
import sys

import pytest
import torch

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from tests.engine_helpers import sage_package  # noqa: F401
from host_attn import voice
from webui_attn.routing import detect, ldm_patched

FP32 = 1e-5
LINES = ("reforge", "classic")


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(voice, "_said", set())


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def start(webui_factory, mode, argv=("--attention-pytorch",), early=()):
    """The host started with SDPA chosen; ``early`` model modules are imported before the extension loads
    (as the host's model_base does), the rest after."""
    import importlib
    webui = webui_factory(mode, argv=list(argv))
    import ldm_patched.ldm.modules.attention as attention
    before = {name: importlib.import_module(name) for name in early}
    chosen = attention.optimized_attention
    webui.load_scripts()
    return webui, attention, chosen, before


def test_reforge_is_recognised(webui_factory, capsys):
    start(webui_factory, "reforge")
    assert detect.detect() == detect.REFORGE
    assert f"{voice.PREFIX} reForge: attention routed through lib_attn" in capsys.readouterr().out


def test_classic_is_recognised(webui_factory, capsys):
    start(webui_factory, "classic")
    assert detect.detect() == detect.CLASSIC
    out = capsys.readouterr().out
    assert f"{voice.PREFIX} Forge Classic: attention routed through lib_attn" in out
    assert "not recognised" not in out


def test_reload_ui_says_the_routing_again(webui_factory, capsys):
    webui, _, _, _ = start(webui_factory, "classic")
    line = f"{voice.PREFIX} Forge Classic: attention routed through lib_attn"
    assert capsys.readouterr().out.count(line) == 1
    from modules import script_callbacks
    script_callbacks.script_unloaded_callback()                      # "Reload UI": the routing undone…
    webui.load_scripts()                                              # …and made again
    assert capsys.readouterr().out.count(line) == 1


def test_classic_names_itself_for_blocked_xformers_and_says_when_it_is_not_installed(webui_factory, monkeypatch,
                                                                                    tmp_path):
    import importlib.machinery

    from webui_attn.ui.api import XFORMERS_MISSING, availability
    start(webui_factory, "classic")
    halted = "ModuleNotFoundError: import of xformers halted; None in sys.modules"
    infos = [lib_attn.BackendInfo(b.id, b.label, b.id != "xformers" and b.available,
                                  halted if b.id == "xformers" else b.reason, "") for b in lib_attn.backends()]
    monkeypatch.setattr(lib_attn, "backends", lambda: list(infos))  # what the engine says under that hook
    monkeypatch.setitem(sys.modules, "xformers", None)           # the webui's import hook without --xformers
    xformers = lambda: {r["id"]: r for r in availability()["backends"]}["xformers"]["reason"]  # noqa: E731
    if importlib.machinery.PathFinder.find_spec("xformers") is None:
        assert xformers() == XFORMERS_MISSING
    (tmp_path / "xformers").mkdir()
    (tmp_path / "xformers" / "__init__.py").write_text("")
    with monkeypatch.context() as installed:                      # undone before the webui double is
        installed.syspath_prepend(str(tmp_path))
        reason = xformers()
    assert reason == f"Forge Classic blocks importing xformers unless it is started with --xformers ({halted})"
    assert "A1111" not in reason


@pytest.mark.parametrize("mode", LINES)
def test_cross_attention_matches_the_hosts_sdpa(webui_factory, mode):
    webui, attention, chosen, _ = start(webui_factory, mode)
    assert chosen is attention.attention_pytorch
    assert attention.optimized_attention is not chosen and attention.optimized_attention_masked is not chosen
    layer = attention.CrossAttention(64, context_dim=32, heads=4, dim_head=16).double()
    x, ctx = torch.randn(2, 24, 64, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    mask = torch.randn(2, 1, 24, 7, dtype=torch.float64)           # a form both lines hand to SDPA as it is
    patched = attention.optimized_attention, attention.optimized_attention_masked
    attention.optimized_attention = attention.optimized_attention_masked = chosen
    try:
        ref, ref_masked = layer(x, ctx), layer(x, ctx, mask=mask)
    finally:
        attention.optimized_attention, attention.optimized_attention_masked = patched
    layer.float()
    with lib_attn.recording() as rec:
        out, out_masked = layer(x.float(), ctx.float()), layer(x.float(), ctx.float(), mask=mask.float())
    assert rel_err(out, ref) <= FP32 and rel_err(out_masked, ref_masked) <= FP32
    assert rel_err(ref, ref_masked) > 1e-2                               # the mask mattered
    assert rec.calls == {("unet", "sdpa"): 2}


@pytest.mark.parametrize("early", [True, False])
def test_by_name_copies_are_routed_loaded_before_or_after(webui_factory, early):
    models = ("ldm_patched.ldm.flux.math", "ldm_patched.ldm.wan.model", "ldm_patched.ldm.lumina.model")
    webui, attention, chosen, _ = start(webui_factory, "reforge", early=models if early else ())
    import ldm_patched.ldm.flux.math as flux
    import ldm_patched.ldm.lumina.model as lumina
    import ldm_patched.ldm.wan.model as wan
    for held in (flux.optimized_attention, wan.optimized_attention, lumina.optimized_attention_masked):
        assert held is not chosen and held.__name__ == ("lib_attn_dit_attention" if early else "lib_attn_unet_attention")
    qkv = torch.randn(2, 40, 3, 6, 32, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    x = torch.randn(1, 12, 64, dtype=torch.float64)
    layer = wan.WanSelfAttention(64, 4).double()
    mask = torch.rand(1, 1, 40, 40) > 0.2
    mask[..., 0] = True
    ref_flux = chosen(q, k, v, 6, skip_reshape=True)
    ref_wan = layer.o(chosen(layer.q(x), layer.k(x), layer.v(x), heads=4))
    ref_lumina = chosen(q, k, v, 6, mask, skip_reshape=True)
    with lib_attn.recording() as rec:
        out_flux = flux.attention(q.float(), k.float(), v.float(), None)
        out_wan = layer.float()(x.float())
        out_lumina = lumina.joint_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                            v.transpose(1, 2).float(), 6, mask)
    assert rel_err(out_flux, ref_flux) <= FP32 and rel_err(out_wan, ref_wan) <= FP32
    assert rel_err(out_lumina, ref_lumina) <= FP32
    roles = {role for role, _ in rec.calls}
    # loaded before: found as a DiT's copy; loaded after: they bound the source's own (the UNet's) function
    assert sum(rec.calls.values()) == 3 and roles == ({"dit"} if early else {"unet"})


def test_skip_output_reshape_keeps_the_heads_axis(webui_factory):
    webui, attention, chosen, _ = start(webui_factory, "reforge")
    q = torch.randn(2, 10, 4 * 16)
    out = attention.optimized_attention(q, q, q, 4, skip_output_reshape=True)
    ref = chosen(q.double(), q.double(), q.double(), 4, skip_output_reshape=True)
    assert out.shape == (2, 4, 10, 16) and rel_err(out, ref) <= FP32


@pytest.mark.parametrize("mode", LINES)
def test_vae_blocks_built_before_and_after_are_reached_and_restored(webui_factory, mode):
    webui = webui_factory(mode, argv=["--attention-pytorch"])
    import ldm_patched.ldm.modules.diffusionmodules.model as model
    early = model.AttnBlock(64).double()
    own = early.optimized_attention
    assert own is model.pytorch_attention
    x = torch.randn(1, 64, 6, 6, dtype=torch.float64)
    ref = early(x)
    webui.load_scripts()
    late = model.AttnBlock(64).double()
    late.load_state_dict(early.state_dict())
    with lib_attn.recording() as rec:
        outs = early.float()(x.float()), late.float()(x.float())
    assert rec.calls == {("vae", "sdpa"): 2}
    assert all(rel_err(o, ref) <= FP32 for o in outs)
    ldm_patched.uninstall()
    assert early.optimized_attention is own and late.optimized_attention is own


def test_text_encoders_keep_the_hosts_attention(webui_factory):
    start(webui_factory, "reforge")
    import ldm_patched.ldm.modules.attention as attention
    import ldm_patched.modules.text_encoders.t5 as t5
    assert attention.optimized_attention_for_device(torch.device("cpu"), small_input=True) is attention.attention_pytorch
    q = torch.randn(1, 8, 32)
    bias = torch.randn(1, 4, 8, 8)
    with lib_attn.recording() as rec:
        t5.self_attention(q, q, q, 4, bias)
    assert not rec.calls


@pytest.mark.parametrize("attn_precision,expected", [(None, (torch.bfloat16, None)), (torch.float32, (torch.float32, "keep"))])
def test_reforges_precision_rule_is_called_with_the_dtype(webui_factory, monkeypatch, attn_precision, expected):
    start(webui_factory, "reforge")
    import ldm_patched.ldm.modules.attention as attention
    seen = []
    real = lib_attn.attention
    monkeypatch.setattr(lib_attn, "attention", lambda q, k, v, **kw: seen.append((q.dtype, kw.get("fp32"))) or real(q, k, v, **kw))
    q = torch.randn(1, 16, 64, dtype=torch.bfloat16)
    out = attention.optimized_attention(q, q, q, 4, attn_precision=attn_precision)
    assert seen == [expected] and out.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", LINES)
def test_undo_is_exact(webui_factory, mode):
    models = ("ldm_patched.ldm.flux.math",) if mode == "reforge" else ()
    webui, attention, chosen, before = start(webui_factory, mode, early=models)
    from modules import script_callbacks
    script_callbacks.script_unloaded_callback()
    assert attention.optimized_attention is chosen and attention.optimized_attention_masked is chosen
    for module in before.values():
        assert module.optimized_attention is chosen
    import ldm_patched.ldm.modules.diffusionmodules.model as model
    assert "optimized_attention" not in model.AttnBlock.__dict__


@pytest.mark.parametrize("flag, backend, module", [("--use-flash-attention", "flash-attn", "flash_attn"),
                                                     ("--use-sage-attention3", "sage3", "sageattn")])
def test_a_kernel_flag_without_the_package_starts_and_falls_back(webui_factory, capsys, flag, backend, module):
    """reForge exits at startup when a --use-* flag's package is missing; with this extension the flag
    is claimed first: the webui starts, and the kernel's calls fall back with the reason."""
    info = {b.id: b for b in lib_attn.backends()}[backend]
    if info.available:
        pytest.skip(f"{backend} is installed here: the host would use it itself")
    webui, attention, chosen, _ = start(webui_factory, "reforge", [flag])
    out = capsys.readouterr().out
    assert f"{voice.PREFIX} {flag}: {module} is not installed" in out
    assert f"{voice.PREFIX} reForge {flag}: UNet/DiT attention prefers {backend}" in out
    assert lib_attn.config().preference["unet"] == (backend,)
    q = torch.randn(1, 16, 64)
    with lib_attn.recording() as rec:
        attention.optimized_attention(q, q, q, 4)
    assert rec.fallbacks == {("unet", backend, f"not available: {info.reason}"): 1}


def test_without_the_extension_the_flag_stops_the_host(webui_factory, monkeypatch):
    """What the README says reForge does on its own: the attention module exits at import."""
    if {b.id: b for b in lib_attn.backends()}["flash-attn"].available:
        pytest.skip("flash-attn is installed here")
    monkeypatch.setattr("sys.argv", ["webui.py", "--use-flash-attention"])
    import sys
    from tests.doubles.fixtures import REFORGE_ROOT
    monkeypatch.syspath_prepend(REFORGE_ROOT)
    for name in [n for n in sys.modules if n.startswith("ldm_patched")]:
        monkeypatch.delitem(sys.modules, name)
    from ldm_patched.modules import args_parser
    args_parser.args, _ = args_parser.parser.parse_known_args()
    with pytest.raises(SystemExit):
        import ldm_patched.ldm.modules.attention  # noqa: F401
    for name in [n for n in sys.modules if n.startswith("ldm_patched")]:
        monkeypatch.delitem(sys.modules, name)


def test_roles_of_the_modules_that_hold_a_copy():
    assert ldm_patched.role_of("ldm_patched.ldm.flux.math") == "dit"
    assert ldm_patched.role_of("ldm_patched.ldm.genmo.vae.model") == "vae"
    assert ldm_patched.role_of("ldm_patched.ldm.modules.attention") == "unet"
    assert ldm_patched.role_of("ldm_patched.controlnet.cldm") == "unet"
    assert ldm_patched.role_of("lib_ipadapter.IPAdapterPlus") == "unet"       # an extension's copy


@pytest.mark.parametrize("argv,preference", [([], ("sage",)), (["--disable-sage"], None)])
def test_classic_runs_sage_whenever_it_imports_and_so_does_the_extension(sage_package, webui_factory, capsys, argv,
                                                                          preference):
    """Forge Classic's --sage only installs SageAttention; it uses it whenever it imports."""
    sage_package("2.1.1")
    start(webui_factory, "classic", argv)
    assert lib_attn.config().preference["unet"] == preference
    out = capsys.readouterr().out
    said = (f"{voice.PREFIX} Forge Classic chooses sage on an NVIDIA GPU (sageattention 2.1.1 imports; the host runs it on SDXL only, "
            f"this extension on every model): UNet/DiT attention prefers sage")
    assert (said in out) == (preference is not None)


@pytest.mark.parametrize("module_name,cls,make", [
    ("ldm_patched.ldm.wan.vae", "AttentionBlock", lambda cls: cls(32)),
    ("ldm_patched.ldm.cosmos.cosmos_tokenizer.layers3d", "CausalAttnBlock", lambda cls: cls(32, 8)),
])
def test_reforges_video_vae_blocks_take_the_vae_routing(webui_factory, module_name, cls, make):
    """The Wan VAE and the Cosmos tokenizer store ``vae_attention()`` per block: blocks built before and
    after the extension loads run the VAE chain (``--attn-vae-backend``), match reForge's own, and get
    their own function back on unload."""
    import importlib
    webui = webui_factory("reforge", argv=["--attention-pytorch", "--attn-vae-backend", "math"])
    block_cls = getattr(importlib.import_module(module_name), cls)
    torch.manual_seed(0)
    early = make(block_cls).double()
    own = early.optimized_attention
    x = torch.randn(1, 32, 3, 4, 4, dtype=torch.float64)
    ref = early(x)
    webui.load_scripts()
    late = make(block_cls).double()
    late.load_state_dict(early.state_dict())
    with lib_attn.recording() as rec:
        out_early, out_late = early.float()(x.float()), late.float()(x.float())
    assert rec.calls == {("vae", "math"): 2}
    assert rel_err(out_early, ref) <= FP32 and rel_err(out_late, ref) <= FP32
    ldm_patched.uninstall()
    assert early.optimized_attention is own and late.optimized_attention is own


def test_a_script_file_that_copied_the_chosen_function_is_routed(webui_factory, tmp_path):
    """An extension's script file, loaded by path before this extension (so not in ``sys.modules``), that
    imported ``optimized_attention`` by name: routed, and its own function back on unload."""
    (tmp_path / "copying_script.py").write_text(
        "from ldm_patched.ldm.modules.attention import optimized_attention\n"
        "def call(q, heads):\n"
        "    return optimized_attention(q, q, q, heads)\n")
    webui = webui_factory("reforge", argv=["--attention-pytorch"])
    from modules import script_loading
    script = script_loading.load_module(str(tmp_path / "copying_script.py"))
    own = script.optimized_attention
    webui.load_scripts()
    with lib_attn.recording() as rec:
        script.call(torch.randn(1, 8, 32), 2)
    assert rec.calls == {("unet", "sdpa"): 1}
    ldm_patched.uninstall()
    assert script.optimized_attention is own
