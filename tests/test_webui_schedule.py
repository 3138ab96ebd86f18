"""Schedules in A1111 1.10 and the Forge lines, through each host's double: the webui's own sampler calls
the ``cfg_denoiser`` callbacks at each denoiser call, the extension tells the engine where sampling is,
and the readout counts the calls per rule.

A generation runs as the webui runs one: an API request (``alwayson_scripts`` args over the UI defaults),
``process``, the batch loop (which stops on ``stored.interrupted``), txt2img's Euler sampling of a small
ldm-layout UNet whose attention is the host's own module, a hires pass when asked, the VAE's attention,
the infotext, ``postprocess``.
"""
import html

import pytest
import torch

gr = pytest.importorskip("gradio")

import lib_attn  # noqa: E402
from lib_attn import schedule as schedules  # noqa: E402
from tests import sampling_model  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.sampling_model import CALLS_PER_MODEL_CALL  # noqa: E402
from tests.test_generation import AUTO_TITLE, _clean, prefixed, start  # noqa: E402,F401
from webui_attn.settings import layers, stored  # noqa: E402
from webui_attn.ui import components, readout  # noqa: E402
from webui_attn.routing import sampling  # noqa: E402
from webui_attn.ui.readout import lines, parse_infotext  # noqa: E402

MODES = ("a1111", "forge", "neo", "reforge", "classic")
TWO_KERNELS = "0-50%: sdpa; 50-100%: math"
STEPS = 10


def launch(webui_factory, mode, argv=()):
    runner, demo, output = start(webui_factory, mode, argv, optimization=AUTO_TITLE)
    from modules import shared
    shared.sd_model = sampling_model.build(mode)
    return runner


def generate(runner, mode, args=None, outputs=None, dtype=torch.float32, **kwargs):
    """One ``/sdapi/v1/txt2img`` request; returns (processed, info, outputs)."""
    from modules.api import api
    outputs = [] if outputs is None else outputs
    alwayson = None if args is None else {"Flash Attention": {"args": args}}
    kwargs.setdefault("steps", STEPS)
    processed, info = api.txt2img(runner, alwayson_scripts=alwayson, prompt="a cat", cfg_scale=5.0, seed=3,
                                  sd_model=sampling_model.generation(mode, outputs, dtype=dtype), **kwargs)
    return processed, info, outputs


def by_rule(report):
    """{rule label: {(role, backend): n}} of the one schedule the report holds."""
    (text,) = report.schedules
    return {label: {(role, b): n for role, b, n in items} for label, items in report.rule_items(text)}


@pytest.mark.parametrize("mode", MODES)
def test_two_kernels_by_step_window_count_per_window_and_match_the_unscheduled_image(webui_factory, mode):
    runner = launch(webui_factory, mode)
    processed, info, scheduled = generate(runner, mode, ["use setting", "use setting", TWO_KERNELS])
    report = readout.last_report()
    half = STEPS // 2 * CALLS_PER_MODEL_CALL
    vae = report.backends("vae")
    assert by_rule(report) == {"0-50%": {("unet", "sdpa"): half}, "50-100%": {("unet", "math"): half},
                               "otherwise": {("vae", b): n for b, n in vae}}
    # the per-rule counts add up to every call of the generation
    assert sum(report.rules.values()) == sum(report.calls.values()) == STEPS * CALLS_PER_MODEL_CALL + 1
    line = next(x for x in lines(report) if x.startswith("Attention schedule: "))
    assert line.startswith(f"Attention schedule: 0–50%: sdpa ×{half} · 50–100%: math ×{half} · otherwise: VAE ")
    assert line in processed.comments
    assert f"Schedule: {line.removeprefix('Attention schedule: ')}" in html.unescape(components.report_html(report))
    assert parse_infotext(processed.info)["Attention schedule"] == TWO_KERNELS
    assert info["extra_generation_params"]["Attention schedule"] == TWO_KERNELS
    assert lib_attn.config().schedule is None and schedules.where.progress is None   # over with the generation

    # the same image as the two kernels give unscheduled, within their float32 rounding of a float64 reference
    _, _, sdpa_only = generate(runner, mode, ["sdpa"])
    assert readout.last_report().backends("unet") == [("sdpa", STEPS * CALLS_PER_MODEL_CALL)]
    _, _, math_only = generate(runner, mode, ["math"])
    from modules import shared
    model32 = shared.sd_model
    shared.sd_model = sampling_model.build(mode, "float64", dtype=torch.float64)
    shared.sd_model.unet.load_state_dict({k: v.double() for k, v in model32.unet.state_dict().items()})
    _, _, ref = generate(runner, mode, ["math"], dtype=torch.float64)
    eps = torch.finfo(torch.float32).eps
    for part in (0, 1):   # the latent, the VAE's output
        reference = ref[0][part]
        errors = [(out[0][part].double() - reference).abs().max().item() for out in (scheduled, sdpa_only, math_only)]
        # ten Euler steps at CFG scale 5 from sigma 14.6 magnify each step's rounding: a few thousand ulps
        assert max(errors) <= 4096 * eps * reference.abs().max().item(), errors
        assert errors[0] <= 2 * max(errors[1:]), errors


@pytest.mark.parametrize("mode", MODES)
def test_paste_back_restores_the_schedule_and_runs_it_again(webui_factory, mode):
    runner = launch(webui_factory, mode)
    typed = "steps 0-30 %: sdpa;30-100%:math"   # spelled loosely: the infotext holds its canonical form
    processed, _, _ = generate(runner, mode, ["use setting", "use setting", typed])
    first = by_rule(readout.last_report())
    script = runner.alwayson_scripts[0]
    field, reader = script.infotext_fields[2]
    assert field is script.controls[2] and reader in script.paste_field_names
    pasted = reader(parse_infotext(processed.info))
    assert pasted == "0-30%: sdpa; 30-100%: math"
    # The backend field gets what was chosen (nothing): the schedule's rules chose the backends that ran.
    backend_field, backend_reader = script.infotext_fields[0]
    assert backend_field is script.controls[0] and backend_reader(parse_infotext(processed.info)) == "use setting"
    generate(runner, mode, ["use setting", "use setting", pasted])
    assert by_rule(readout.last_report()) == first
    assert first["0-30%"] == {("unet", "sdpa"): 3 * CALLS_PER_MODEL_CALL}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text,part", [
    ("0-50%: sdpa; 50-100: math", "schedule rule 2 ('50-100: math'): '50-100' is not a condition; valid conditions:"),
    ("0-50%: sdpa; 50-100%: fastest", "schedule rule 2 ('50-100%: fastest'): unknown backend id 'fastest'; valid ids:"),
])
def test_a_bad_schedule_is_refused_before_sampling_with_the_part_that_is_wrong(webui_factory, capsys, mode, text,
                                                                               part):
    runner = launch(webui_factory, mode)
    capsys.readouterr()
    processed, info, outputs = generate(runner, mode, ["sdpa-math", "full", text])
    assert outputs == []                                   # the batch loop stopped before sampling
    report = readout.last_report()
    assert report.calls == {} and report.rules == {}
    (note,) = report.notes
    assert note.startswith(f"generation refused: schedule for this generation: {part}")
    assert f"Attention note: {note}" in processed.comments   # what the webui shows under the (absent) image
    assert any(part in line for line in prefixed(capsys.readouterr().out))
    assert parse_infotext(processed.info)["Attention note"] == note
    # nothing of it applied, the backend and guard of the same request included
    assert layers.get_layer("generation") is None and lib_attn.config().schedule is None
    assert lib_attn.config().guard == "on"
    from modules import shared
    assert shared.state.interrupted                        # until the next job begins
    generate(runner, mode)                                 # the next request runs
    assert not shared.state.interrupted and readout.last_report().backends("unet")


def test_a_bad_schedule_setting_refuses_generations_that_leave_it_to_the_setting(webui_factory, capsys):
    runner = launch(webui_factory, "forge")
    from modules.api import api
    capsys.readouterr()
    api.set_config({stored.KEY_SCHEDULE: "first 0: math"})
    said = [line for line in prefixed(capsys.readouterr().out) if stored.KEY_SCHEDULE in line]
    assert len(said) == 1 and "'first 0' names no block" in said[0]
    assert layers.get_layer("settings") is None             # not applied
    _, _, outputs = generate(runner, "forge")
    assert outputs == [] and readout.last_report().notes[-1].startswith(
        f"generation refused: setting {stored.KEY_SCHEDULE}: schedule rule 1 ('first 0: math')")
    _, _, outputs = generate(runner, "forge", ["use setting", "use setting", "off"])   # none for this one: runs
    assert len(outputs) == 1 and readout.last_report().rules == {}
    api.set_config({stored.KEY_SCHEDULE: TWO_KERNELS})
    generate(runner, "forge")
    assert set(by_rule(readout.last_report())) == {"0-50%", "50-100%", "otherwise"}


def test_the_flag_sets_the_default_and_the_field_turns_it_off(webui_factory):
    runner = launch(webui_factory, "neo", ["--attn-schedule", "cross: math"])
    assert layers.get_layer("flags")["schedule"] == "cross: math"
    generate(runner, "neo")
    assert by_rule(readout.last_report())["cross"] == {("unet", "math"): STEPS * CALLS_PER_MODEL_CALL // 2}
    generate(runner, "neo", ["use setting", "use setting", "off"])
    assert readout.last_report().rules == {}


@pytest.mark.parametrize("mode", ["a1111", "reforge"])
def test_a_bad_flag_is_said_at_startup_and_ignored(webui_factory, capsys, mode):
    runner = launch(webui_factory, mode, ["--attn-schedule", "0-50%: sdpa; 40-100%: sdpa; blocks 3-1: math"])
    (line,) = [x for x in prefixed(capsys.readouterr().out) if "--attn-schedule" in x]
    assert "schedule rule 3 ('blocks 3-1: math')" in line and "lower index to the higher" in line
    assert line.endswith("The flag is ignored.")
    assert (layers.get_layer("flags") or {}).get("schedule") is None
    generate(runner, mode)
    assert readout.last_report().rules == {} and not readout.last_report().notes


@pytest.mark.parametrize("mode", MODES)
def test_the_hires_pass_starts_its_progress_again(webui_factory, mode):
    runner = launch(webui_factory, mode)
    hires = dict(steps=4, enable_hr=True, hr_second_pass_steps=4, denoising_strength=0.75)  # 4 + (3 + 1) calls
    generate(runner, mode, ["use setting", "use setting", TWO_KERNELS], **hires)
    rules = by_rule(readout.last_report())
    assert rules["0-50%"] == {("unet", "sdpa"): 4 * CALLS_PER_MODEL_CALL}     # 2 calls of each pass
    assert rules["50-100%"] == {("unet", "math"): 4 * CALLS_PER_MODEL_CALL}
    generate(runner, mode, ["use setting", "use setting", "hires 50-100%: sdpa-math; 0-50%: sdpa; 50-100%: math"],
             **hires)
    rules = by_rule(readout.last_report())
    per_half = 2 * CALLS_PER_MODEL_CALL
    assert rules["50-100% hires"] == {("unet", "sdpa-math"): per_half}
    assert rules["0-50%"] == {("unet", "sdpa"): 2 * per_half}        # the first half of both passes
    assert rules["50-100%"] == {("unet", "math"): per_half}           # the base pass's second half


@pytest.mark.parametrize("mode", MODES)
def test_block_rules_take_the_calls_of_their_blocks(webui_factory, mode):
    runner = launch(webui_factory, mode)
    generate(runner, mode, ["use setting", "use setting", "first 2: math; last 1: sdpa-math; blocks 2-2 cross: math"],
             steps=3)
    rules = by_rule(readout.last_report())
    model_calls = 3
    assert rules["first 2"] == {("unet", "math"): 2 * 2 * model_calls}       # blocks 0, 1: self and cross
    assert rules["last 1"] == {("unet", "sdpa-math"): 2 * model_calls}       # block 4
    assert rules["blocks 2-2 cross"] == {("unet", "math"): model_calls}      # the middle block's cross-attention
    otherwise = rules["otherwise"]
    assert sum(n for (role, _), n in otherwise.items() if role == "unet") == 3 * model_calls   # 2 self, 3 cross
    from modules import shared
    assert not any(m._forward_pre_hooks for m, _ in schedules.block_modules(shared.sd_model.unet))   # removed


def test_the_refiner_gets_its_own_pass_and_its_blocks(webui_factory):
    runner = launch(webui_factory, "a1111")
    from modules import shared
    base = shared.sd_model
    refiner = sampling_model.build("a1111", "refiner", seed=1)
    generate(runner, "a1111", ["use setting", "use setting", "refiner first 1: sdpa-math; refiner: math; base: sdpa"],
             steps=4, refiner_checkpoint_info=refiner.sd_checkpoint_info, refiner_switch_at=0.5)
    assert shared.sd_model is refiner
    rules = by_rule(readout.last_report())
    assert rules["base"] == {("unet", "sdpa"): 2 * CALLS_PER_MODEL_CALL}
    assert rules["first 1 refiner"] == {("unet", "sdpa-math"): 2 * 2}      # block 0 of the refiner's model
    assert rules["refiner"] == {("unet", "math"): 2 * (CALLS_PER_MODEL_CALL - 2)}
    assert not any(m._forward_pre_hooks for model in (base, refiner)
                   for m, _ in schedules.block_modules(model.unet))


@pytest.mark.parametrize("text,reads", [(TWO_KERNELS, 0), ("sigma 20-1: math", STEPS)])
def test_sigma_is_read_only_for_a_sigma_rule(webui_factory, monkeypatch, text, reads):
    runner = launch(webui_factory, "a1111")
    seen = []
    original = sampling.sigma_of
    monkeypatch.setattr(sampling, "sigma_of", lambda params: seen.append(1) or original(params))
    generate(runner, "a1111", ["use setting", "use setting", text])
    assert len(seen) == reads
    if reads:
        from modules.sd_samplers_kdiffusion import get_sigmas
        inside = sum(1 <= s <= 20 for s in get_sigmas(STEPS, torch.float32)[:-1].tolist())
        assert by_rule(readout.last_report())["sigma 20-1"] == {("unet", "math"): inside * CALLS_PER_MODEL_CALL}


def test_the_schedule_field_and_the_setting(webui_factory):
    runner = launch(webui_factory, "a1111")
    script = runner.alwayson_scripts[0]
    field = script.controls[2]
    assert isinstance(field, gr.Textbox) and field.value == "" and field.label == "Schedule for this generation"
    from modules import shared
    info = shared.opts.data_labels[stored.KEY_SCHEDULE]
    assert info.default == "" and info.component is gr.Textbox
    assert readout.INFOTEXT_SCHEDULE_KEY == "Attention schedule"


def test_a_timestep_samplers_timestep_is_read_as_its_sigma():
    """DDIM, PLMS and UniPC pass a timestep where k-diffusion samplers pass a sigma; their denoiser holds
    the model's cumulative alphas, and sigma = sqrt((1 - a) / a) at that timestep."""
    from types import SimpleNamespace
    alphas = torch.linspace(0.9991, 0.0047, 1000, dtype=torch.float64)
    t = torch.tensor([700.0, 700.0])
    params = SimpleNamespace(sigma=t, denoiser=SimpleNamespace(alphas=alphas))
    a = alphas[700].item()
    assert sampling.sigma_of(params) == pytest.approx(((1 - a) / a) ** 0.5, rel=1e-12)
    k_params = SimpleNamespace(sigma=torch.tensor([3.25, 3.25]), denoiser=SimpleNamespace())
    assert sampling.sigma_of(k_params) == 3.25
