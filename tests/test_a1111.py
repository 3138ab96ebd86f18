"""The A1111 adapter against the A1111 1.10.1 double: entries, "Automatic", parity with ``sdp``, undo."""
import sys
import types

import pytest
import torch

import lib_attn
import webui_attn.ui
from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.routing import a1111, forwards
from host_attn import voice
from webui_attn.settings import layers

TITLES = {
    "flash": "flash-attn - FlashAttention 2/3, falls back per call",
    "cudnn": "sdp-cudnn - PyTorch cuDNN attention, falls back per call",
    "efficient": "sdp-efficient - PyTorch memory-efficient attention, falls back per call",
    "sage": "sage - SageAttention, falls back per call",
    "auto": "attn-auto - fastest available per call",
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def simulate_backends(monkeypatch, available):
    """Make the engine's probe report ``available`` (a set of ids) as usable; the rest not."""
    infos = [lib_attn.BackendInfo(i, i, i in available, "" if i in available else "simulated: absent", "")
             for i in lib_attn.BACKEND_IDS]
    monkeypatch.setattr(lib_attn, "backends", lambda: list(infos))


def start(webui_factory, argv=(), device=None):
    webui = webui_factory("a1111", argv=list(argv))
    if device is not None:
        from modules import shared
        shared.device = torch.device(device)   # a device object only; nothing touches CUDA
    webui.load_scripts()
    return webui


def selected():
    from modules import sd_hijack
    sd_hijack.model_hijack.apply_optimizations()
    return sd_hijack.current_optimizer


# --- entries -----------------------------------------------------------------------------------------

def test_titles_never_change(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, set(lib_attn.BACKEND_IDS))
    start(webui_factory)
    from modules import sd_hijack, shared, shared_items
    ours = {o.webui_attn_entry.key: o for o in sd_hijack.optimizers if a1111.is_ours(o)}
    assert {k: o.title() for k, o in ours.items()} == TITLES
    assert {k: o.cmd_opt for k, o in ours.items() if k != "auto"} == {
        "flash": "opt_flash_attention", "cudnn": "opt_cudnn_attention",
        "efficient": "opt_efficient_attention", "sage": "opt_sage_attention"}
    assert all(hasattr(shared.cmd_opts, o.cmd_opt) for k, o in ours.items() if k != "auto")
    choices = shared_items.cross_attention_optimizations()
    assert set(TITLES.values()) <= set(choices) and choices[0] == "Automatic" and choices[-1] == "None"


def test_the_startup_line_on_a_gpu_groups_by_cause_and_says_how_to_install(monkeypatch):
    from types import SimpleNamespace
    infos = {"flash-attn": lib_attn.BackendInfo("flash-attn", "", False, "ModuleNotFoundError: No module named 'flash_attn'", ""),
             "sage": lib_attn.BackendInfo("sage", "", False, "ModuleNotFoundError: No module named 'sageattention'", ""),
             "sdpa-cudnn": lib_attn.BackendInfo("sdpa-cudnn", "", False, "cuDNN is not available in this torch build", ""),
             "sdpa-efficient": lib_attn.BackendInfo("sdpa-efficient", "", True, "", "")}
    monkeypatch.setattr(a1111, "available_backends", lambda: infos)
    monkeypatch.setattr(a1111, "default_device", lambda: "cuda")      # a GPU machine, without touching CUDA
    monkeypatch.setattr(a1111, "flag_given", lambda entry: False)
    from host_attn import status
    assert a1111.not_offered_line() == (
        f"Not listed in {a1111.SETTING_PATH}: flash-attn, sage (not installed) — {status.WEBUI_INSTALL_HINT}; "
        "sdp-cudnn (not in this torch build)")


def test_entries_follow_the_engine_probe_and_say_why_once(webui_factory, monkeypatch, capsys):
    monkeypatch.setattr(voice, "_said", set())
    simulate_backends(monkeypatch, {"sdpa-efficient", "sdpa", "math"})
    webui = start(webui_factory)
    from modules import shared_items
    choices = shared_items.cross_attention_optimizations()
    assert TITLES["efficient"] in choices and TITLES["auto"] in choices
    assert TITLES["flash"] not in choices and TITLES["sage"] not in choices
    said = [line for line in capsys.readouterr().out.splitlines() if "Not listed in" in line]
    # one line for every entry not listed, grouped by cause: these GPU kernels on a machine without a GPU
    assert said == [f"{voice.PREFIX} Not listed in {a1111.SETTING_PATH}: flash-attn, sdp-cudnn, sage "
                    "(need an NVIDIA or AMD GPU)"]
    webui.reload_ui()
    assert "Not listed in" not in capsys.readouterr().out


# --- "Automatic" ---------------------------------------------------------------------------------------

FUSED = {"flash-attn", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sage", "sdpa", "math"}


@pytest.mark.parametrize("flag,key", [
    ("--opt-flash-attention", "flash"),
    ("--opt-cudnn-attention", "cudnn"),
    ("--opt-efficient-attention", "efficient"),
    ("--opt-sage-attention", "sage"),
    ("--attn-backend=sdpa-flash,sdpa", "auto"),
    ("--attn-vae-backend=sdpa", "auto"),
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_flag_always_wins(webui_factory, monkeypatch, flag, key, device):
    simulate_backends(monkeypatch, FUSED)
    # --xformers is a built-in flag (priority 100) given at the same time: ours still wins
    start(webui_factory, [flag, "--xformers"], device=device)
    assert selected().title() == TITLES[key]


def test_on_a_mac_a1111_keeps_sub_quadratic(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, FUSED)
    start(webui_factory, device="mps")
    assert selected().name == "sub-quadratic"


def test_on_a_cpu_automatic_picks_auto_over_invokeai(webui_factory, monkeypatch):
    """Measured faster than InvokeAI on a CPU (``a1111.engine_wins_on_cpu``), so it outranks InvokeAI's 1000."""
    simulate_backends(monkeypatch, {"sdpa", "sdpa-math", "math"})
    start(webui_factory, device="cpu")
    assert selected().title() == TITLES["auto"]


def test_on_a_cpu_without_sdpa_a1111_keeps_invokeai(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, {"math"})
    start(webui_factory, device="cpu")
    assert selected().name == "InvokeAI"


def test_on_cuda_with_a_fused_kernel_automatic_picks_auto(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, {"sdpa-efficient", "sdpa", "math"})
    start(webui_factory, device="cuda")
    assert selected().title() == TITLES["auto"]


def test_on_cuda_without_a_fused_kernel_doggettx_stays(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, {"sdpa", "sdpa-math", "math"})
    start(webui_factory, device="cuda")
    assert selected().name == "Doggettx"


@pytest.mark.parametrize("available,expected", [
    ({"sdpa-efficient", "sdpa-flash", "sdpa", "math"}, "xformers"),
    ({"flash-attn", "sdpa-flash", "sdpa", "math"}, TITLES["auto"]),
    ({"sdpa-cudnn", "sdpa", "math"}, TITLES["auto"]),
])
def test_against_xformers_auto_wins_only_with_a_faster_kernel(webui_factory, monkeypatch, available, expected):
    simulate_backends(monkeypatch, available)
    start(webui_factory, ["--force-enable-xformers"], device="cuda")
    assert selected().title() == expected


@pytest.mark.parametrize("flag,key,backend", [
    ("--opt-flash-attention", "flash", "flash-attn"),
    ("--opt-sage-attention", "sage", "sage"),
    ("--opt-cudnn-attention", "cudnn", "sdpa-cudnn"),
])
def test_flag_for_a_backend_that_cannot_run_still_routes_through_the_engine(
        webui_factory, monkeypatch, capsys, flag, key, backend):
    """CPU: the flag's backend cannot run (no package, or no CUDA); its entry is offered anyway, "Automatic"
    picks it, each call falls back with the reason counted, and startup says so in one line."""
    monkeypatch.setattr(voice, "_said", set())
    info = {b.id: b for b in lib_attn.backends()}[backend]
    if info.available:
        pytest.skip(f"{backend} runs here")
    webui = start(webui_factory, [flag], device="cpu")
    assert selected().title() == TITLES[key]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{voice.PREFIX} --")]
    assert lines == [f"{voice.PREFIX} {flag}: UNet/DiT attention goes through this extension, {backend} first; "
                     f"cannot run here: {backend} ({info.reason}), so its calls fall back per call, counted "
                     f"with the reason in the readout"]
    import ldm.modules.attention as ldm_attention
    module = ldm_attention.CrossAttention(320, None, 8, 40)
    with lib_attn.recording() as rec:
        module(torch.randn(1, 16, 320))
        module(torch.randn(1, 16, 320))
    assert rec.fallbacks == {("unet", backend, "not available: " + info.reason): 2}
    assert sum(rec.calls.values()) == 2
    webui.reload_ui()                                     # said once per process
    assert f"{voice.PREFIX} --" not in capsys.readouterr().out


def test_unknown_backend_id_leaves_a1111_choice(webui_factory, monkeypatch, capsys):
    monkeypatch.setattr(voice, "_said", set())
    simulate_backends(monkeypatch, FUSED)
    start(webui_factory, ["--attn-backend", "flash,sdpa"], device="mps")
    assert selected().name == "sub-quadratic"
    out = capsys.readouterr().out
    assert "'flash'" in out and ", ".join(lib_attn.BACKEND_IDS) in out


def test_disable_opt_split_attention_still_means_nothing(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, FUSED)
    start(webui_factory, ["--disable-opt-split-attention"], device="cuda")
    assert selected() is None


# --- parity with the built-in sdp forward -----------------------------------------------------------

def apply_ours(key="auto"):
    from modules import sd_hijack
    assert sd_hijack.apply_optimizations(TITLES[key]) == a1111.ENTRY_BY_KEY[key].name


def cross_attention_cases():
    import ldm.modules.attention as ldm_attention
    import sgm.modules.attention as sgm_attention
    return {
        # SD1.5: heads 8 with d 40 (self), d 160 (cross, context 768)
        "sd15-self-d40": (ldm_attention.CrossAttention(320, None, 8, 40), (2, 64, 320), None),
        "sd15-cross-d160": (ldm_attention.CrossAttention(1280, 768, 8, 160), (2, 16, 1280), (2, 77, 768)),
        # SDXL: d 64, 10 heads, context 2048
        "sdxl-cross-d64": (sgm_attention.CrossAttention(640, 2048, 10, 64), (1, 64, 640), (1, 77, 2048)),
        "sdxl-self-d64": (sgm_attention.CrossAttention(640, None, 10, 64), (1, 64, 640), None),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_matches_sdp(webui_factory, dtype):
    start(webui_factory)
    from modules import sd_hijack_optimizations as sho
    apply_ours()
    for name, (module, x_shape, ctx_shape) in cross_attention_cases().items():
        x = torch.randn(x_shape, dtype=torch.float64)
        ctx = None if ctx_shape is None else torch.randn(ctx_shape, dtype=torch.float64)
        ref = sho.scaled_dot_product_attention_forward(module.double(), x, ctx)
        module.to(dtype)
        with lib_attn.recording() as rec:
            out = module(x.to(dtype), context=None if ctx is None else ctx.to(dtype))
        sdp = sho.scaled_dot_product_attention_forward(module, x.to(dtype), None if ctx is None else ctx.to(dtype))
        assert out.dtype == dtype and out.shape == ref.shape, name
        assert sum(n for (role, _), n in rec.calls.items() if role == "unet") == 1, name
        assert rel_err(out, ref) <= TOL[dtype], name
        assert rel_err(out, sdp) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vae_blocks_match_sdp(webui_factory, dtype):
    start(webui_factory)
    import ldm.modules.diffusionmodules.model as ldm_model
    import sgm.modules.diffusionmodules.model as sgm_model
    from modules import sd_hijack_optimizations as sho
    apply_ours()
    for cls in (ldm_model.AttnBlock, ldm_model.MemoryEfficientAttnBlock, sgm_model.AttnBlock):
        module = cls(512)
        # a small input keeps the residual from hiding the attention branch (GroupNorm rescales it)
        x = torch.randn(1, 512, 8, 8, dtype=torch.float64) * 0.01
        ref = sho.sdp_attnblock_forward(module.double(), x)
        module.to(dtype)
        with lib_attn.recording() as rec:
            out = module(x.to(dtype))
        sdp = sho.sdp_attnblock_forward(module, x.to(dtype))
        assert out.dtype == dtype and out.shape == x.shape, cls
        assert rec.calls and all(role == "vae" for role, _ in rec.calls), cls
        assert rel_err(out, ref) <= TOL[dtype], cls
        assert rel_err(out, sdp) <= TOL[dtype], cls


def test_sgm_kwargs_are_absorbed(webui_factory):
    start(webui_factory)
    import sgm.modules.attention as sgm_attention
    apply_ours()
    module = sgm_attention.CrossAttention(64, None, 2, 32)
    x = torch.randn(1, 8, 64)
    out = module(x, additional_tokens=None, n_times_crossframe_attn_in_self=0)
    assert out.shape == x.shape


def test_hypernetworks_are_applied_exactly_as_sdp(webui_factory):
    start(webui_factory)
    import ldm.modules.attention as ldm_attention
    from modules import shared, sd_hijack_optimizations as sho
    from modules.hypernetworks import hypernetwork
    apply_ours()
    module = ldm_attention.CrossAttention(320, 768, 8, 40).double()
    x, ctx = torch.randn(2, 32, 320, dtype=torch.float64), torch.randn(2, 77, 768, dtype=torch.float64)
    plain = module(x, context=ctx)
    hn = hypernetwork.Hypernetwork(layers={768: (torch.nn.Linear(768, 768).double(), torch.nn.Linear(768, 768).double())})
    shared.loaded_hypernetworks.append(hn)
    try:
        out = module(x, context=ctx)
        ref = sho.scaled_dot_product_attention_forward(module, x, ctx)
    finally:
        shared.loaded_hypernetworks.clear()
    assert rel_err(out, plain) > 1e-3           # the hypernetwork changed k and v
    assert rel_err(out, ref) <= 1e-12
    assert not hasattr(module, "hyper_k")       # like the optimized built-ins: no layer=self


def spy_engine(monkeypatch):
    seen = []
    real = lib_attn.attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, kwargs.get("fp32"), kwargs.get("role")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(lib_attn, "attention", spy)
    return seen


@pytest.mark.parametrize("argv,upcast,expected", [
    ((), False, (torch.bfloat16, None)),
    ((), True, (torch.float32, "keep")),
    (("--attn-fp32", "cast"), True, (torch.float32, None)),
])
def test_upcast_attn_is_honoured(webui_factory, monkeypatch, argv, upcast, expected):
    start(webui_factory, argv)
    import ldm.modules.attention as ldm_attention
    from modules import shared, sd_hijack_optimizations as sho
    apply_ours()
    shared.opts.upcast_attn = upcast
    seen = spy_engine(monkeypatch)
    module = ldm_attention.CrossAttention(320, 768, 8, 40).to(torch.bfloat16)
    x, ctx = torch.randn(1, 16, 320, dtype=torch.bfloat16), torch.randn(1, 77, 768, dtype=torch.bfloat16)
    out = module(x, context=ctx)
    assert seen == [(expected[0], expected[1], "unet")]
    assert out.dtype == torch.bfloat16
    assert rel_err(out, sho.scaled_dot_product_attention_forward(module, x, ctx)) <= TOL[torch.bfloat16]


def test_settings_change_needs_no_repatching(webui_factory):
    start(webui_factory)
    import ldm.modules.attention as ldm_attention
    apply_ours()
    forward = ldm_attention.CrossAttention.forward
    module = ldm_attention.CrossAttention(64, None, 2, 32)
    x = torch.randn(1, 8, 64)
    layers.set_layer("settings", {"preference": {"unet": ["math"]}})
    with lib_attn.recording() as rec:
        module(x)
    assert rec.calls == {("unet", "math"): 1}
    layers.set_layer("settings", {"preference": {"unet": ["sdpa-math"]}})
    with lib_attn.recording() as rec:
        module(x)
    assert set(rec.calls) == {("unet", "sdpa-math")}
    assert ldm_attention.CrossAttention.forward is forward


def test_entry_puts_its_backend_first_for_the_denoiser_only(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, FUSED)
    start(webui_factory, ["--attn-vae-backend", "sdpa"])
    apply_ours("efficient")
    pref = lib_attn.config().preference
    assert pref["unet"] == ("sdpa-efficient",) and pref["dit"] == ("sdpa-efficient",)
    assert pref["vae"] == ("sdpa",)


def test_sd3_attention_is_routed_when_present(webui_factory):
    start(webui_factory)
    from modules.models.sd3 import mmdit, other_impls
    original = mmdit.attention
    apply_ours()
    assert mmdit.attention is not original and other_impls.attention is original
    block = mmdit.SelfAttention(128, 4).double()
    x = torch.randn(1, 24, 128, dtype=torch.float64)
    with lib_attn.recording() as rec:
        out = block(x)
    q, k, v = block.qkv(x).chunk(3, dim=-1)
    ref = block.proj(original(q, k, v, 4))
    assert set(role for role, _ in rec.calls) == {"dit"}
    assert rel_err(out, ref) <= 1e-12
    from modules import sd_hijack
    sd_hijack.current_optimizer.undo()
    assert mmdit.attention is original


# --- undo ----------------------------------------------------------------------------------------------

def targets():
    import ldm.modules.attention as la
    import ldm.modules.diffusionmodules.model as lm
    import sgm.modules.attention as sa
    import sgm.modules.diffusionmodules.model as sm
    return {
        "ldm.CrossAttention": (la.CrossAttention, "forward"), "sgm.CrossAttention": (sa.CrossAttention, "forward"),
        "ldm.AttnBlock": (lm.AttnBlock, "forward"), "ldm.MemoryEfficientAttnBlock": (lm.MemoryEfficientAttnBlock, "forward"),
        "sgm.AttnBlock": (sm.AttnBlock, "forward"),
    }


def snapshot():
    return {name: getattr(owner, attr) for name, (owner, attr) in targets().items()}


def our_optimizer(key="auto"):
    from modules import sd_hijack
    return next(o for o in sd_hijack.optimizers if a1111.is_ours(o) and o.webui_attn_entry.key == key)


def test_undo_restores_identity_twice(webui_factory):
    start(webui_factory)
    before = snapshot()
    optimizer = our_optimizer()
    optimizer.apply()
    patched = snapshot()
    assert all(patched[n] is not before[n] for n in before)
    assert patched["ldm.CrossAttention"] is forwards.cross_attention_forward
    assert patched["sgm.AttnBlock"] is forwards.attnblock_forward
    optimizer.apply()                           # applying again is harmless
    optimizer.undo()
    assert all(snapshot()[n] is before[n] for n in before)
    optimizer.undo()
    assert all(snapshot()[n] is before[n] for n in before)
    assert layers.get_layer("optimizer") is None


def test_undo_puts_sgms_own_attnblock_back_after_a1111s_quirk(webui_factory):
    start(webui_factory)
    import sgm.modules.diffusionmodules.model as sm
    from modules import sd_hijack, sd_hijack_optimizations as sho
    sd_hijack.undo_optimizations()
    assert sm.AttnBlock.forward is sho.diffusionmodules_model_AttnBlock_forward   # the quirk
    optimizer = our_optimizer()
    optimizer.apply()
    optimizer.undo()
    assert sm.AttnBlock.forward is sho.sgm_diffusionmodules_model_AttnBlock_forward


def test_apply_after_a1111_reset_the_forwards_without_our_undo(webui_factory):
    start(webui_factory)
    from modules import sd_hijack, sd_hijack_optimizations as sho
    before = snapshot()
    apply_ours("auto")
    sd_hijack.model_hijack.undo_hijack(None)   # resets the four forwards, never calls our undo()
    sd_hijack.current_optimizer = None         # as after a failed apply: nobody will call it either
    assert snapshot()["ldm.CrossAttention"] is not forwards.cross_attention_forward
    apply_ours("auto")
    patched = snapshot()
    assert all(patched[n] is (forwards.cross_attention_forward if "Cross" in n else forwards.attnblock_forward)
               for n in patched)
    sd_hijack.apply_optimizations("sdp - scaled dot product")
    assert not a1111.patches.active
    assert snapshot()["ldm.MemoryEfficientAttnBlock"] is before["ldm.MemoryEfficientAttnBlock"]
    assert snapshot()["sgm.AttnBlock"] is sho.sdp_attnblock_forward


def test_switching_to_a_builtin_restores_what_a1111_does_not_know(webui_factory):
    start(webui_factory)
    import ldm.modules.diffusionmodules.model as lm
    from modules import sd_hijack, sd_hijack_optimizations as sho
    memory_efficient = lm.MemoryEfficientAttnBlock.forward
    apply_ours("auto")
    assert lm.MemoryEfficientAttnBlock.forward is forwards.attnblock_forward
    sd_hijack.apply_optimizations("sdp - scaled dot product")
    assert lm.MemoryEfficientAttnBlock.forward is memory_efficient
    assert lm.AttnBlock.forward is sho.sdp_attnblock_forward
    assert not a1111.patches.active


def test_reload_ui_leaves_nothing_stale(webui_factory):
    webui = start(webui_factory)
    from modules import script_callbacks, sd_hijack
    apply_ours("auto")
    old_optimizer = sd_hijack.current_optimizer
    script_callbacks.script_unloaded_callback()          # first half of "Reload UI"
    assert not a1111.patches.active
    import ldm.modules.attention as la
    from modules.hypernetworks import hypernetwork
    assert la.CrossAttention.forward is hypernetwork.attention_CrossAttention_forward
    unpatched = snapshot()
    webui.load_scripts()                                 # second half: scripts re-imported, list rebuilt
    assert sd_hijack.current_optimizer is old_optimizer  # A1111 does not re-apply ...
    assert la.CrossAttention.forward is forwards.cross_attention_forward   # ... so the script did
    sd_hijack.apply_optimizations("sdp - scaled dot product")   # next model load / setting change
    old_optimizer.undo()                                         # a stale instance's undo is harmless
    assert not a1111.patches.active
    from modules import sd_hijack_optimizations as sho
    assert la.CrossAttention.forward is sho.scaled_dot_product_attention_forward
    assert snapshot()["ldm.MemoryEfficientAttnBlock"] is unpatched["ldm.MemoryEfficientAttnBlock"]


# --- the entry script ----------------------------------------------------------------------------------

@pytest.fixture
def stub_panel(monkeypatch):
    calls = []
    panel = types.ModuleType("webui_attn.ui.panel")
    panel.title = lambda: "Flash Attention"
    panel.ui = lambda script, is_img2img: calls.append(("ui", is_img2img)) or ["component"]
    panel.process = lambda p, *args: calls.append(("process", p, args))
    panel.postprocess = lambda p, processed, *args: calls.append(("postprocess", p, processed, args))
    panel.on_ui_settings = lambda: calls.append(("on_ui_settings",))
    panel.on_app_started = lambda demo, app: calls.append(("on_app_started", demo, app))
    panel.watch_generations = lambda: calls.append(("watch_generations",))
    panel.unwatch_generations = lambda: calls.append(("unwatch_generations",))
    monkeypatch.setitem(sys.modules, "webui_attn.ui.panel", panel)
    monkeypatch.setattr(webui_attn.ui, "panel", panel, raising=False)
    return calls


@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_entry_script_delegates_to_the_panel(webui_factory, stub_panel, mode):
    webui = webui_factory(mode)
    webui.load_scripts()
    from modules import script_callbacks, scripts
    (cls,) = webui.script_classes()
    script = cls()
    assert script.title() == "Flash Attention"
    assert script.show(False) is scripts.AlwaysVisible
    assert script.ui(True) == ["component"]
    script.process("p", "flash-attn")
    script.postprocess("p", "processed", "flash-attn")
    script_callbacks.ui_settings_callback()
    script_callbacks.app_started_callback("demo", "app")
    assert stub_panel == [("watch_generations",), ("ui", True), ("process", "p", ("flash-attn",)),
                          ("postprocess", "p", "processed", ("flash-attn",)), ("on_ui_settings",),
                          ("on_app_started", "demo", "app")]
