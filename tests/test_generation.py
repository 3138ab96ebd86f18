"""What a user meets in a running webui, through the doubles' own script runner and API handling.

A generation here goes the webui's way: the script runner builds the scripts' UI and gives each its slice
of ``p.script_args``; an API request's ``alwayson_scripts`` args go over the UI defaults by index; the
runner catches and logs each script's exception; sampling runs the patched ldm modules, so attention goes
through whatever optimizer A1111 applied (the engine only when it is one of this extension's).
"""
import html
import json

import pytest
import torch

gr = pytest.importorskip("gradio")

import lib_attn  # noqa: E402
from webui_attn.ui.readout import lines, parse_infotext, to_infotext  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.ui_helpers import event_handler  # noqa: E402
from webui_attn.routing import a1111, detect, forge  # noqa: E402
from webui_attn.settings import choices, layers, stored  # noqa: E402
from host_attn import voice  # noqa: E402
from webui_attn.ui import components, panel  # noqa: E402
from webui_attn.ui import readout
from lib_attn.readout import guard_lines

AUTO_TITLE = a1111.ENTRY_BY_KEY["auto"].title
SCRIPT = "flash attention"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(voice, "_said", set())
    lib_attn.reset()
    panel.reset()
    yield
    panel.reset()
    layers.reset()
    lib_attn.reset()


def start(webui_factory, mode="a1111", argv=(), optimization=None, jobs=False):
    """Start a double as the webui does: scripts, optimizer list, the model's optimizer applied (A1111),
    the settings page and the txt2img tab (script UI, then the output panel). ``jobs``: the Forge line's
    own job path (``tests/doubles/forge_jobs``)."""
    webui = webui_factory(mode, argv=list(argv), jobs=jobs)
    webui.load_scripts()
    from modules import script_callbacks, scripts, sd_hijack, shared, ui_common
    if mode == "a1111":
        if optimization is not None:   # chosen in Settings → Optimizations, where A1111 reads it
            shared.opts.cross_attention_optimization = optimization
        sd_hijack.model_hijack.apply_optimizations()   # what loading the model does
    script_callbacks.ui_settings_callback()
    runner = scripts.scripts_txt2img
    scripts.scripts_current = runner
    runner.initialize_scripts(False)
    with gr.Blocks() as demo:
        runner.setup_ui()
        output = ui_common.create_output_panel("txt2img")
    scripts.scripts_current = None
    return runner, demo, output


def sample(p=None):
    """Sampling and decoding as the model runs them: the ldm modules A1111 patches (on Forge the rebound
    ``attention_function`` of ``backend.nn.unet`` and the VAE's)."""
    if detect.detect() == detect.FORGE:
        import backend.nn.unet as unet
        import backend.nn.vae as vae
        q = torch.randn(1, 16, 320)
        for _ in range(3):
            unet.attention_function(q, q, q, 8)
        x = torch.randn(1, 64, 4, 4)
        vae.attention_function_single_head_spatial(x, x, x)
        return
    import ldm.modules.attention as ldm_attention
    import ldm.modules.diffusionmodules.model as ldm_model
    block = ldm_attention.CrossAttention(320, None, 8, 40)
    vae = ldm_model.AttnBlock(64)
    with torch.no_grad():
        for _ in range(3):
            block(torch.randn(1, 16, 320))
        vae(torch.randn(1, 64, 4, 4))


def txt2img(runner, args=None):
    """One ``/sdapi/v1/txt2img`` request with ``alwayson_scripts`` for this extension when ``args`` is given."""
    from modules.api import api
    alwayson = None if args is None else {"Flash Attention": {"args": args}}
    return api.txt2img(runner, alwayson_scripts=alwayson, sd_model=sample, prompt="a cat")


def prefixed(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(voice.PREFIX)]


# --- 1, 2: the extension is not in the path --------------------------------------------------------------

@pytest.mark.parametrize("optimization,ran_on", [
    ("InvokeAI", "A1111's InvokeAI optimizer"),
    ("sdp - scaled dot product", "A1111's sdp optimizer"),
    ("None", "A1111's attention without an optimization"),
])
def test_a1111_builtin_in_use_is_named_and_no_infotext_claims_otherwise(webui_factory, optimization, ran_on):
    runner, _, _ = start(webui_factory, optimization=optimization)
    processed, info = txt2img(runner)
    report = readout.last_report()
    assert report.calls == {} and report.ran_on.startswith(ran_on)
    head = lines(report)[0]
    assert head.startswith(f"Attention: {ran_on}") and "not through this extension" in head
    hint = lines(report)[-1]
    assert hint.startswith("Attention note: to route attention through this extension") and AUTO_TITLE in hint
    assert "--opt-flash-attention" in hint and "Settings → Optimizations → Cross attention optimization" in hint
    assert all(line in processed.comments for line in lines(report))   # under the image
    params = parse_infotext(processed.info)
    assert "Attention" not in params and "Attention fallbacks" not in params and "Attention note" not in params
    assert "Attention" not in info["extra_generation_params"]
    assert html.escape(ran_on) in components.report_html(report)                   # the accordion


def test_override_that_cannot_apply_says_why(webui_factory):
    runner, _, _ = start(webui_factory, optimization="InvokeAI")
    processed, info = txt2img(runner, ["sdpa-math"])
    report = readout.last_report()
    note = "override 'sdpa-math' not applied: attention runs on A1111's InvokeAI optimizer"
    assert report.notes == (note,)
    assert f"Attention note: {note}" in processed.comments
    assert parse_infotext(processed.info)["Attention note"] == note
    assert info["extra_generation_params"]["Attention note"] == note


def test_schedule_that_cannot_apply_says_why(webui_factory):
    runner, _, _ = start(webui_factory, optimization="InvokeAI")
    processed, _ = txt2img(runner, ["use setting", "use setting", "0-50%: sdpa; 50-100%: math"])
    note = ("schedule '0-50%: sdpa; 50-100%: math' not applied: attention runs on A1111's InvokeAI optimizer")
    assert readout.last_report().notes == (note,)
    assert parse_infotext(processed.info)["Attention note"] == note


def test_status_route_says_what_ran(webui_factory):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from webui_attn.ui import api
    runner, _, _ = start(webui_factory, optimization="InvokeAI")
    from modules import script_callbacks
    app = FastAPI()
    script_callbacks.app_started_callback(None, app)
    client = TestClient(app)
    routing = client.get(api.ROUTE).json()["routing"]
    assert routing["routed"] is False and routing["ran_on"] == "A1111's InvokeAI optimizer"
    assert AUTO_TITLE in routing["hint"]
    txt2img(runner)
    body = client.get(api.ROUTE).json()["last_report"]
    assert body["calls"] == [] and body["ran_on"] == "A1111's InvokeAI optimizer"
    assert body["text"][0].startswith("Attention: A1111's InvokeAI optimizer, not through this extension")


def test_our_entry_whose_forwards_a1111_reset_is_not_claimed(webui_factory):
    runner, _, _ = start(webui_factory, optimization=AUTO_TITLE)
    from modules import sd_hijack
    sd_hijack.undo_optimizations()          # e.g. training: resets the forwards without our undo()
    txt2img(runner)
    report = readout.last_report()
    assert report.calls == {} and "reset the forwards" in report.ran_on
    assert AUTO_TITLE in report.hint


def test_forge_without_patches_is_named(webui_factory):
    runner, _, _ = start(webui_factory, "forge")
    forge.uninstall()
    txt2img(runner)
    assert readout.last_report().ran_on == "Forge's own attention (backend.attention)"


# --- routed: override honoured, API info carries the text -------------------------------------------------

@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_routed_override_is_honoured_and_api_info_has_the_infotext_text(webui_factory, mode):
    runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
    processed, info = txt2img(runner, ["sdpa-math"])
    report = readout.last_report()
    assert report.backends("unet") == [("sdpa-math", 3)] and report.ran_on is None and not report.notes
    params = parse_infotext(processed.info)
    assert params["Attention"] == to_infotext(report)["Attention"]
    assert info["extra_generation_params"]["Attention"] == params["Attention"]    # not null
    assert "Attention note" not in info["extra_generation_params"]


def test_api_info_carries_the_fallbacks_text(webui_factory):
    runner, _, _ = start(webui_factory, "forge")
    processed, info = txt2img(runner, ["flash-attn"])
    report = readout.last_report()
    if not report.fallbacks:
        pytest.skip("flash-attn runs here")
    assert info["extra_generation_params"]["Attention fallbacks"] == to_infotext(report)["Attention fallbacks"]


# --- 5, 6: the override's values ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["a1111", "forge"])
@pytest.mark.parametrize("args,seen", [
    (["nonexistent"], "'nonexistent'"),
    ([123], "123"),
    ("math", "'m'"),          # a string, not a list: the webui takes its first character
])
def test_bad_override_is_logged_and_noted(webui_factory, capsys, mode, args, seen):
    runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
    capsys.readouterr()
    processed, info = txt2img(runner, args)
    report = readout.last_report()
    auto = lib_attn.explain(*[torch.randn(1, 8, 16, 40)] * 3, role="unet").backend
    # a string's third character is the third argument, the schedule 't': no rule, so the generation is refused
    assert report.backends("unet") == ([] if isinstance(args, str) else [(auto, 3)])   # else the setting (Auto) ran
    (line,) = [line for line in prefixed(capsys.readouterr().out) if "override" in line]
    assert f"override {seen} ignored" in line and ", ".join(lib_attn.BACKEND_IDS) in line
    assert "use setting" in line
    note, *more = report.notes
    assert note.startswith(f"override {seen} ignored")
    if isinstance(args, str):  # its second character is the second argument, the guard: refused too
        guard, refused = more
        assert guard.startswith("guard 'a' ignored, the setting used; valid: use setting, on, full, off")
        assert refused.startswith("generation refused: schedule for this generation: schedule rule 1 ('t'): "
                                  "no ':' between conditions and backends")
    else:
        assert more == []
    assert all(f"Attention note: {n}" in processed.comments for n in report.notes)
    assert parse_infotext(processed.info)["Attention note"] == "; ".join(report.notes)
    assert info["extra_generation_params"]["Attention note"] == "; ".join(report.notes)


def test_empty_args_are_the_ui_default(webui_factory, capsys):
    """``"args": []`` leaves the UI default ("use setting") in place: the webui passes the script exactly
    what it passes when the key is left out, so there is nothing to tell apart."""
    runner, _, _ = start(webui_factory, optimization=AUTO_TITLE)
    txt2img(runner, [])
    assert readout.last_report().notes == ()
    assert "override" not in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_labels_listed_for_the_dropdown_are_accepted_back(webui_factory, mode):
    """Forge's script-info lists a dropdown's labels; each one sent back picks its backend."""
    runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
    control = runner.alwayson_scripts[0].controls[0]
    listed = [c[0] if isinstance(c, tuple) else c for c in control.choices]    # script-info's rule
    assert listed[0] == choices.USE_SETTING
    labels = dict(choices.override_choices(pairs=True)[1:])                          # gradio 4's labels
    for label, backend in [*zip(listed[1:], lib_attn.BACKEND_IDS), *labels.items()]:
        txt2img(runner, [label])
        report = readout.last_report()
        assert not report.notes, label
        assert report.fallbacks or report.backends("unet") == [(backend, 3)], label
        assert backend in {b for (_, b, _) in report.fallbacks} | {b for (_, b) in report.calls}, label


def test_a_raising_script_does_not_stop_the_generation(webui_factory, capsys, monkeypatch):
    """The runner catches each script's exception (as A1111 does): the generation goes on without us."""
    runner, _, _ = start(webui_factory, optimization=AUTO_TITLE)
    def fail():
        raise RuntimeError("any failure inside process")
    monkeypatch.setattr(detect, "routing", fail)
    processed, info = txt2img(runner, ["sdpa"])
    assert processed is not None and "Error running process" in capsys.readouterr().err


# --- 7: bad values stored through /sdapi/v1/options ---------------------------------------------------------

@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_bad_settings_from_the_api_are_logged_noted_and_listed(webui_factory, capsys, mode):
    runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
    from modules.api import api
    capsys.readouterr()
    api.set_config({stored.KEY_BACKEND: "definitely-not-a-backend", stored.KEY_FP32: "sideways"})
    lines = prefixed(capsys.readouterr().out)
    backend_line = next(line for line in lines if "definitely-not-a-backend" in line)
    assert stored.KEY_BACKEND in backend_line and ", ".join(lib_attn.BACKEND_IDS) in backend_line
    fp32_line = next(line for line in lines if "sideways" in line)
    assert stored.KEY_FP32 in fp32_line and "Auto, cast, keep" in fp32_line

    processed, _ = txt2img(runner)
    report = readout.last_report()
    assert len(report.notes) == 2 and all("ignored" in n for n in report.notes)
    assert layers.get_layer("settings") is None                 # both ignored: Auto, as if unset
    assert lib_attn.config().fp32 == "cast"
    assert all(f"Attention note: {n}" in processed.comments for n in report.notes)
    from webui_attn.ui.api import availability
    ignored = availability()["ignored_settings"]
    assert ignored == list(report.notes)
    assert "definitely-not-a-backend" in components.availability_html()


# --- 8: the readout follows each generation ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_readout_redraws_when_the_generation_ends(webui_factory, mode):
    runner, demo, output = start(webui_factory, mode, optimization=AUTO_TITLE)
    script = runner.alwayson_scripts[0]
    readout_html = next(c for c in demo.blocks.values() if getattr(c, "elem_id", None) == "flash_attn_txt2img_readout")
    assert not any(getattr(c, "elem_id", "") == "flash_attn_txt2img_refresh" for c in demo.blocks.values())
    fn, outputs = event_handler(demo, output.html_log)
    assert outputs == [readout_html._id]
    assert "No generation yet" in fn("")
    txt2img(runner, ["sdpa-math"])
    assert fn("Time taken: 1 sec.") == components.report_html(readout.last_report()) and "sdpa-math" in fn("")
    assert script.args_to - script.args_from == 4  # the backend override, the guard, the schedule, sparse


# --- 12: one prefix ------------------------------------------------------------------------------------------

def test_engine_warnings_carry_the_prefix(webui_factory, capsys):
    runner, _, _ = start(webui_factory, "forge")
    capsys.readouterr()
    txt2img(runner, ["flash-attn"])
    report = readout.last_report()
    if not report.fallbacks:
        pytest.skip("flash-attn runs here")
    out = capsys.readouterr().out
    assert any(line.startswith(f"{voice.PREFIX} attention: flash-attn passed over") for line in out.splitlines())
    assert json.dumps(report.to_dict())


def test_forge_says_at_startup_what_a_flag_does(webui_factory, capsys):
    info = {b.id: b for b in lib_attn.backends()}["flash-attn"]
    if info.available:
        pytest.skip("flash-attn runs here")
    runner, _, _ = start(webui_factory, "forge", ["--opt-flash-attention"])
    lines = [line for line in prefixed(capsys.readouterr().out) if "--opt-flash-attention" in line]
    assert len(lines) == 1 and f"flash-attn ({info.reason})" in lines[0]
    txt2img(runner)
    assert readout.last_report().fallbacks == {("unet", "flash-attn", "not available: " + info.reason): 3}


# --- the guard: a faulty kernel named for a generation --------------------------------------------------

def recorded_sample(outputs: list):
    """``sample`` on fixed inputs, keeping what each attention block returned (the "image")."""
    def run(p=None):
        gen = torch.Generator().manual_seed(7)
        if detect.detect() == detect.FORGE:
            import backend.nn.unet as unet
            for _ in range(3):
                q = torch.randn(1, 16, 320, generator=gen)
                outputs.append(unet.attention_function(q, q, q, 8))
            return
        import ldm.modules.attention as ldm_attention
        torch.manual_seed(7)
        block = ldm_attention.CrossAttention(320, None, 8, 40)
        with torch.no_grad():
            for _ in range(3):
                outputs.append(block(torch.randn(1, 16, 320, generator=gen)))
    return run


@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_a_faulty_kernel_named_for_a_generation_gives_the_good_kernels_image(webui_factory, monkeypatch, tmp_path,
                                                                             mode):
    from lib_attn import tuning_file
    from tests import faulty_backends

    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path))
    tuning_file.forget_memory()
    faulty_backends.register()
    try:
        runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
        from modules.api import api
        good = []
        api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": ["sdpa"]}}, sd_model=recorded_sample(good),
                    prompt="a cat")
        for bid in faulty_backends.IDS:
            image = []
            processed, info = api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": [bid]}},
                                          sd_model=recorded_sample(image), prompt="a cat")
            assert len(image) == len(good) == 3 and all(torch.equal(a, b) for a, b in zip(image, good)), bid
            report = readout.last_report()
            # fk-nan3 is right twice, then caught on its third call; the others on their first
            assert report.calls == ({("unet", bid): 2, ("unet", "sdpa"): 1} if bid == "fk-nan3"
                                    else {("unet", "sdpa"): 3}), bid
            (said,) = guard_lines(report)
            assert said.startswith(f"guard: {bid}") and said.endswith("→ sdpa (recomputed)"), said
            assert f"Attention guard: {said.removeprefix('guard: ')}" in processed.comments
            assert parse_infotext(processed.info)["Attention guard"] == said.removeprefix("guard: ")
            tuning_file.clear()  # the next start would skip it: each kernel is caught on its own first call here
            lib_attn.reset()
    finally:
        faulty_backends.unregister()
        tuning_file.forget_memory()


@pytest.mark.parametrize("mode", ["a1111", "forge"])
def test_the_guard_over_the_api_and_a_bad_value(webui_factory, mode):
    from tests import faulty_backends

    faulty_backends.register()
    try:
        runner, _, _ = start(webui_factory, mode, optimization=AUTO_TITLE)
        image = []
        from modules.api import api
        api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": ["fk-nan", "off"]}},
                    sd_model=recorded_sample(image), prompt="a cat")
        assert all(o.isnan().all() for o in image) and not readout.last_report().guard  # off: as asked
        assert lib_attn.config().guard == "on"  # for that generation only
        processed, _ = txt2img(runner, ["use setting", "sometimes"])
        (note,) = readout.last_report().notes
        assert note.startswith("guard 'sometimes' ignored, the setting used; valid: use setting, on, full, off")
    finally:
        faulty_backends.unregister()


# --- A1111's own attention flags: what they do to the extension's part -----------------------------------

SDP_FLAG = "--opt-sdp-attention"


def test_a1111_flag_keeps_its_optimizer_and_startup_line_says_so(webui_factory, capsys):
    runner, _, _ = start(webui_factory, argv=[SDP_FLAG])
    from modules import sd_hijack
    assert sd_hijack.current_optimizer.name == "sdp"                 # A1111 takes the flag's optimizer first
    line = next(x for x in prefixed(capsys.readouterr().out) if SDP_FLAG in x)
    assert f"{SDP_FLAG} (A1111): with Cross attention optimization \"Automatic\"" in line
    assert f"{SDP_FLAG} picks sdp" in line and "only in generations that ask for it" in line
    assert "schedule or sparse attention set in this extension's settings or flags" in line
    assert "a backend, schedule or sparse attention chosen for the generation" in line
    assert AUTO_TITLE in line and "--opt-flash-attention" in line
    txt2img(runner)                                                  # asks for nothing: A1111's sdp runs
    report = readout.last_report()
    assert report.calls == {} and report.ran_on == "A1111's sdp optimizer"


@pytest.mark.parametrize("asked", ["override", "setting"])
def test_a1111_flag_yields_to_a_generation_that_asks_for_the_engine(webui_factory, asked):
    runner, _, _ = start(webui_factory, argv=[SDP_FLAG])
    import ldm.modules.attention as ldm_attention
    from modules import sd_hijack_optimizations as sho
    from modules import shared
    if asked == "setting":
        shared.opts.set(stored.KEY_BACKEND, "sdpa-math")
    processed, info = txt2img(runner, ["sdpa-math"] if asked == "override" else None)
    report = readout.last_report()
    assert report.backends("unet") == [("sdpa-math", 3)] and report.ran_on is None
    note = next(n for n in report.notes if n.startswith("this generation went through this extension"))
    assert "A1111's sdp optimizer that \"Automatic\" applied (from --opt-sdp-attention)" in note
    assert ldm_attention.CrossAttention.forward is sho.scaled_dot_product_attention_forward   # sdp's again
    assert not a1111.patches.active and detect.routing().routed is False


def test_an_a1111_entry_chosen_by_name_stays(webui_factory):
    runner, _, _ = start(webui_factory, argv=[SDP_FLAG], optimization="sdp - scaled dot product")
    txt2img(runner, ["sdpa-math"])
    report = readout.last_report()
    assert report.calls == {} and "override 'sdpa-math' not applied: attention runs on A1111's sdp" in report.notes[0]


def test_own_flag_beside_an_a1111_flag_routes_every_generation(webui_factory, capsys):
    runner, _, _ = start(webui_factory, argv=[SDP_FLAG, "--opt-flash-attention"])
    from modules import sd_hijack
    assert sd_hijack.current_optimizer.name == "flash-attn"
    line = next(x for x in prefixed(capsys.readouterr().out) if SDP_FLAG in x)
    assert "this extension's own flag is given too and ranks first" in line


def test_disabled_optimizations_stay_disabled(webui_factory, capsys):
    runner, _, _ = start(webui_factory, argv=["--disable-opt-split-attention"])
    assert any("--disable-opt-split-attention (A1111)" in x for x in prefixed(capsys.readouterr().out))
    txt2img(runner, ["sdpa-math"])
    assert readout.last_report().calls == {}


# --- a denoiser whose calls the routing does not reach ------------------------------------------------------

class Sd3Checkpoint:
    """A loaded SD3 checkpoint as Forge holds it (``forge_objects.unet.model.diffusion_model``, an
    ``MMDiTX``); calling it samples as Forge does: the ``cfg_denoiser`` callbacks, then the model, per step."""

    def __init__(self, steps=2):
        import types
        import backend.nn.mmditx as mmditx
        torch.manual_seed(0)
        self.net = mmditx.MMDiTX(hidden_size=64, num_heads=4, depth=1, context_dim=32)
        self.forge_objects = types.SimpleNamespace(unet=types.SimpleNamespace(
            model=types.SimpleNamespace(diffusion_model=self.net)))
        self.steps = steps

    def __call__(self, p):
        from modules.script_callbacks import CFGDenoiserParams, cfg_denoiser_callback
        x = torch.randn(1, 16, 64)
        for step in range(self.steps):
            cfg_denoiser_callback(CFGDenoiserParams(x, None, torch.ones(1), step, self.steps, None, None, None))
            with torch.no_grad():
                x = self.net(x, torch.randn(1, 64), torch.randn(1, 6, 32))


def sd3_txt2img(runner, args):
    from modules.api import api
    return api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": args}}, sd_model=Sd3Checkpoint(),
                       prompt="a cat")


def test_forge_sd3_with_an_override_counts_its_calls_through_the_extension(webui_factory):
    runner, _, _ = start(webui_factory, "forge")
    processed, info = sd3_txt2img(runner, ["math"])
    report = readout.last_report()
    assert report.backends("dit") == [("math", 2)] and not report.notes
    params = parse_infotext(processed.info)
    assert params["Attention override"] == "math" and "Attention note" not in params
    assert lines(report)[0].startswith("Attention: math") and "×2" in lines(report)[0]


def test_denoiser_calls_that_miss_the_extension_are_named_and_the_override_not_recorded(webui_factory):
    """Another extension holds SD3's attention: its calls run there, and nothing claims the override ran."""
    runner, _, _ = start(webui_factory, "forge")
    import backend.nn.mmditx as mmditx
    forge.uninstall()
    mmditx.attention = lambda q, k, v, heads, mask=None: q
    forge.install()
    processed, info = sd3_txt2img(runner, ["math"])
    report = readout.last_report()
    assert not report.backends("dit") and not report.backends("unet")
    note = ("the denoiser's attention (backend.nn.mmditx.MMDiTX) did not go through this extension: it ran on "
            "Forge's own attention or another extension's; override 'math' not applied to it")
    assert report.notes == (note,)
    params = parse_infotext(processed.info)
    assert "Attention override" not in params and params["Attention note"] == note
    assert "Attention override" not in info["extra_generation_params"]
    assert info["extra_generation_params"]["Attention note"] == note
    assert f"Attention note: {note}" in lines(report)
