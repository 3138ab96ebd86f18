"""Generations in Forge, Forge Neo and reForge that change the model inside the job: the refiner, a hires
checkpoint, the reload back to the selected checkpoint at the next batch, a reload that fails.

These hosts choose their attention function once, and the extension routes it where their model code looks
it up at every call (module globals, a descriptor for blocks that store it), so a model they build anew
inside a job runs through the extension as the first did; there is nothing to put back at the job's end but
the generation's own settings. Forge and Neo run here on doubles of their own job path
(``tests/doubles/forge_jobs``, ``neo_jobs``: ``process_images`` with ``set_config``, the batch loop's
``forge_model_reload``, the refiner and hires switches through ``main_entry.checkpoint_change``, a new model
object at every load); reForge's job path is A1111's (``reload_model_weights`` at the refiner, the hires
pass and each batch start), which the A1111 double has.
"""
import pytest
import torch

gr = pytest.importorskip("gradio")

from tests import sampling_model  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.sampling_model import CALLS_PER_MODEL_CALL  # noqa: E402
from tests.test_generation import _clean, start  # noqa: E402,F401
from webui_attn.routing import detect  # noqa: E402
from webui_attn.settings import layers, stored  # noqa: E402
from webui_attn.ui import panel, readout  # noqa: E402
from webui_attn.ui.readout import parse_infotext  # noqa: E402

STEPS = 4
PER_BATCH = STEPS * CALLS_PER_MODEL_CALL
#: asks for a backend CPU lacks: every UNet call falls back, counted per image
ASK = ["flash-attn"]
#: Neo's refiner switches at a sigma; the 4-step Karras schedule here runs sigmas 14.6, 3.3, 0.55, 0.03
NEO_SWITCH = 1.0


def launch(webui_factory, mode):
    runner, _, _ = start(webui_factory, mode, argv=["--attention-pytorch"], jobs=mode in ("forge", "neo"))
    if mode in ("forge", "neo"):
        base = sampling_model.save_checkpoint(mode, "base", seed=0)
        refiner = sampling_model.save_checkpoint(mode, "refiner", seed=1)
        sampling_model.select("base")
        return runner, base, refiner
    from modules import sd_models
    base = sampling_model.build(mode, "base", seed=0)
    refiner = sampling_model.build(mode, "refiner", seed=1)
    sd_models.load_model(base.sd_checkpoint_info)
    return runner, base.sd_checkpoint_info, refiner.sd_checkpoint_info


def generate(runner, mode, args=ASK, refiner=None, switch_at=0.5, **kwargs):
    """One API request; on reForge the model's sampling routine is the double's ``sd_model``."""
    from modules.api import api
    kwargs.setdefault("steps", STEPS)
    if refiner is not None:
        if mode in ("forge", "neo"):
            kwargs.update(refiner_checkpoint=refiner.title, refiner_switch_at=NEO_SWITCH if mode == "neo" else switch_at)
        else:
            kwargs.update(refiner_checkpoint_info=refiner, refiner_switch_at=switch_at)
    if mode not in ("forge", "neo"):
        kwargs["sd_model"] = sampling_model.generation(mode, [])
    scripts = None if args is None else {"Flash Attention": {"args": args}}
    return api.txt2img(runner, alwayson_scripts=scripts, prompt="a cat", cfg_scale=5.0, seed=3, **kwargs)


def unet_fallbacks(infotext) -> str:
    return parse_infotext(infotext).get("Attention fallbacks", "").split(":")[0]


def nothing_left_open():
    return not panel._open and layers.get_layer("generation") is None and detect.routing().routed


@pytest.mark.parametrize("mode", ["forge", "reforge"])
def test_a_refiner_and_batch_count_two_count_every_call_in_each_image(webui_factory, mode):
    runner, base, refiner = launch(webui_factory, mode)
    from modules import shared
    plain, _ = generate(runner, mode, n_iter=2)
    assert [unet_fallbacks(t) for t in plain.infotexts] == [f"flash-attn ×{PER_BATCH}"] * 2

    refined, info = generate(runner, mode, n_iter=2, refiner=refiner)
    assert shared.sd_model.sd_checkpoint_info is refiner            # each batch switched to the refiner
    for text in refined.infotexts:
        fields = parse_infotext(text)
        assert fields["Refiner"] == refiner.short_title
        assert fields["Attention"].startswith("sdpa") and "VAE sdpa" in fields["Attention"]   # its decode too
    assert [unet_fallbacks(t) for t in refined.infotexts] == [f"flash-attn ×{PER_BATCH}"] * 2
    report = readout.last_report()
    assert sum(report.fallbacks.values()) == 2 * PER_BATCH and report.ran_on is None
    assert nothing_left_open()


def test_forge_builds_a_new_model_at_every_switch_and_each_runs_through_the_extension(webui_factory, monkeypatch):
    runner, base, refiner = launch(webui_factory, "forge")
    from modules import processing, script_callbacks, sd_models, shared
    loaded, decoded_by = [], []
    script_callbacks.on_model_loaded(loaded.append)
    decode = processing.decode_latent_batch
    monkeypatch.setattr(processing, "decode_latent_batch", lambda model, batch: decoded_by.append(model) or decode(model, batch))
    generate(runner, "forge", n_iter=2, refiner=refiner)
    # batch 1: the refiner; batch 2: the base again (forge_model_reload at its start), then the refiner
    assert [m.sd_checkpoint_info.name for m in loaded] == ["refiner", "base", "refiner"]
    assert len({id(m) for m in loaded}) == 3 and shared.sd_model is loaded[-1]
    report = readout.last_report()
    assert sum(report.fallbacks.values()) == 2 * PER_BATCH             # every model's UNet calls
    # Forge decodes with the job's first model (p.sd_model is set once per job): routed as well
    assert decoded_by[0] is decoded_by[1] and all(decoded_by[0] is not m for m in loaded)
    assert report.backends("vae") == [("sdpa", 2)]
    assert sd_models.select_checkpoint() is base                      # the selected checkpoint is the base


@pytest.mark.parametrize("mode", ["forge", "reforge"])
def test_a_hires_checkpoint_keeps_the_second_pass_in_the_extension(webui_factory, mode):
    runner, base, refiner = launch(webui_factory, mode)
    from modules import shared
    hires = dict(enable_hr=True, hr_second_pass_steps=STEPS, denoising_strength=0.5)
    same, _ = generate(runner, mode, **hires)
    other = {"hr_checkpoint_name": refiner.title} if mode == "forge" else {"hr_checkpoint_info": refiner}
    switched, _ = generate(runner, mode, **hires, **other)
    assert shared.sd_model.sd_checkpoint_info is refiner               # the hires pass ran on it
    expected = f"flash-attn ×{(STEPS + STEPS // 2 + 1) * CALLS_PER_MODEL_CALL}"
    assert unet_fallbacks(same.infotexts[0]) == unet_fallbacks(switched.infotexts[0]) == expected
    assert nothing_left_open()


def test_a_generation_that_fails_in_the_refiner_ends_and_a_setting_chosen_then_is_in_force(webui_factory):
    runner, base, refiner = launch(webui_factory, "forge")
    from backend import loader
    from modules import sd_models, shared
    build = loader.files[refiner.filename]

    def runs_out_of_memory():
        model = build()

        def apply_model(*args, **kwargs):
            raise RuntimeError("CUDA out of memory")
        model.apply_model = apply_model
        return model

    loader.files[refiner.filename] = runs_out_of_memory
    with pytest.raises(RuntimeError, match="out of memory"):
        generate(runner, "forge", refiner=refiner, n_iter=2)
    assert nothing_left_open()
    assert sd_models.select_checkpoint() is base                      # Forge's finally put it back
    loader.files[refiner.filename] = build
    shared.opts.set(stored.KEY_BACKEND, "math")                        # Settings → Apply (its onchange)
    generate(runner, "forge", args=None, n_iter=2, refiner=refiner)
    assert readout.last_report().backends("unet") == [("math", 2 * PER_BATCH)]
    assert nothing_left_open()


def test_neos_refiner_fails_in_neo_and_leaves_nothing_of_the_generation(webui_factory):
    """Neo deletes the model it drops (``forge_objects`` and the rest) and still decodes with it
    (``p.sd_model``, set once per job): the batch in which its refiner switched fails there."""
    runner, base, refiner = launch(webui_factory, "neo")
    with pytest.raises(AttributeError, match="forge_objects"):
        generate(runner, "neo", refiner=refiner)
    assert nothing_left_open()
    from modules import shared
    shared.opts.set(stored.KEY_BACKEND, "math")
    plain, _ = generate(runner, "neo", args=None, n_iter=2)            # the next job loads the base again
    assert readout.last_report().backends("unet") == [("math", 2 * PER_BATCH)]
    assert all(parse_infotext(t)["Attention"].startswith("math") for t in plain.infotexts)


@pytest.mark.parametrize("mode", ["forge", "neo"])
def test_a_requests_settings_hold_through_the_refiner_and_are_put_back_after_the_job(webui_factory, mode):
    runner, base, refiner = launch(webui_factory, mode)
    from modules import shared
    kwargs = {"refiner": refiner} if mode == "forge" else {}
    generate(runner, mode, args=None, n_iter=2, override_settings={stored.KEY_BACKEND: "math"}, **kwargs)
    assert readout.last_report().backends("unet") == [("math", 2 * PER_BATCH)]
    assert shared.opts.data[stored.KEY_BACKEND] == stored.DEFAULTS[stored.KEY_BACKEND]
    assert layers.get_layer("settings") is None and nothing_left_open()
    generate(runner, mode, args=None)
    assert [backend for backend, _ in readout.last_report().backends("unet")] != ["math"]
