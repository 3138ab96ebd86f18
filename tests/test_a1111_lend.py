"""A generation that asks for the extension while A1111's own flag (``--opt-sdp-attention``) has "Automatic"
apply A1111's ``sdp``: the extension's forwards are lent for the whole generation, through every reload A1111
makes inside it (the refiner's switch, a hires checkpoint, the switch back at the next batch), and A1111's are
put back only when it ends, by the generation that lent them.

Generations run as an API request through the A1111 1.10.1 doubles: ``process_images`` (back to the selected
checkpoint first), the batch loop (which switches back at each batch start), k-diffusion's Euler sampling of
a small ldm-layout UNet, ``apply_refiner`` and the hires switch calling ``reload_model_weights``, whose
``undo_hijack``/``hijack`` reset the forwards and re-apply the optimizer as A1111 does.
"""
import pytest
import torch

gr = pytest.importorskip("gradio")

from tests import sampling_model  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.sampling_model import CALLS_PER_MODEL_CALL  # noqa: E402
from tests.test_generation import AUTO_TITLE, _clean, start  # noqa: E402,F401
from webui_attn.routing import a1111, detect  # noqa: E402
from webui_attn.settings import layers  # noqa: E402
from webui_attn.ui import panel, readout  # noqa: E402
from webui_attn.ui.readout import parse_infotext  # noqa: E402

SDP_FLAG = "--opt-sdp-attention"
STEPS = 4
#: asks for the extension with a backend CPU lacks: every UNet call falls back, counted per image
ASK = ["flash-attn"]


def launch(webui_factory, argv=(SDP_FLAG,), optimization=None):
    runner, _, _ = start(webui_factory, argv=argv, optimization=optimization)
    from modules import sd_models
    base = sampling_model.build("a1111", "base", seed=0)
    other = sampling_model.build("a1111", "refiner", seed=1)
    sd_models.load_model(base.sd_checkpoint_info)   # the webui's first load: selected, hijacked
    return runner, base, other


def generate(runner, args=ASK, outputs=None, **kwargs):
    from modules.api import api
    kwargs.setdefault("steps", STEPS)
    return api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": args}}, prompt="a cat", cfg_scale=5.0,
                       seed=3, sd_model=sampling_model.generation("a1111", [] if outputs is None else outputs),
                       **kwargs)


def unet_fallbacks(infotext) -> str:
    """The UNet's fallback count an image's infotext records (``flash-attn ×N``)."""
    return parse_infotext(infotext).get("Attention fallbacks", "").split(":")[0]


def a1111_sdp_in_place():
    import ldm.modules.attention as ldm_attention
    from modules import sd_hijack
    from modules import sd_hijack_optimizations as sho
    return (ldm_attention.CrossAttention.forward is sho.scaled_dot_product_attention_forward
            and sd_hijack.current_optimizer.name == "sdp")


def test_a_refiner_and_batch_count_two_keep_every_call_in_the_extension(webui_factory, capsys):
    runner, base, refiner = launch(webui_factory)
    per_batch = STEPS * CALLS_PER_MODEL_CALL
    plain, _ = generate(runner, n_iter=2)
    assert [unet_fallbacks(t) for t in plain.infotexts] == [f"flash-attn ×{per_batch}"] * 2
    capsys.readouterr()

    refined, info = generate(runner, n_iter=2, refiner_checkpoint_info=refiner.sd_checkpoint_info,
                             refiner_switch_at=0.5)
    out = capsys.readouterr().out
    # A1111 re-applied its sdp at the refiner's switch and at the switch back to the base for batch 2
    assert out.count("Applying attention optimization: sdp") >= 3, out
    assert [unet_fallbacks(t) for t in refined.infotexts] == [f"flash-attn ×{per_batch}"] * 2
    assert all(parse_infotext(t)["Attention"].startswith("sdpa") for t in refined.infotexts)
    assert "VAE" in parse_infotext(refined.infotexts[1])["Attention"]            # the decode after the refiner
    report = readout.last_report()
    assert sum(report.fallbacks.values()) == 2 * per_batch and report.ran_on is None
    # the job is over: A1111's sdp is back, nothing of the lend is left
    assert a1111_sdp_in_place() and not a1111._lends and detect.routing().routed is False


def test_a_hires_checkpoint_keeps_the_second_pass_in_the_extension(webui_factory):
    runner, base, other = launch(webui_factory)
    same, _ = generate(runner, enable_hr=True, hr_second_pass_steps=STEPS, denoising_strength=0.5)
    switched, _ = generate(runner, enable_hr=True, hr_second_pass_steps=STEPS, denoising_strength=0.5,
                           hr_checkpoint_info=other.sd_checkpoint_info)
    from modules import shared
    assert shared.sd_model is other                     # the hires pass ran on the other checkpoint
    assert unet_fallbacks(switched.infotexts[0]) == unet_fallbacks(same.infotexts[0])
    assert unet_fallbacks(same.infotexts[0]) == f"flash-attn ×{(STEPS + STEPS // 2 + 1) * CALLS_PER_MODEL_CALL}"
    assert a1111_sdp_in_place() and not a1111._lends


def test_a_generation_that_raised_leaves_nothing_lent_and_an_entry_chosen_then_stays(webui_factory):
    runner, base, refiner = launch(webui_factory)
    from modules import shared
    from modules.api import api

    def raises(p):
        p.sample(torch.zeros(1, 8, 32), torch.zeros(1, 8, 32), torch.zeros(1, 16, 32))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        api.txt2img(runner, alwayson_scripts={"Flash Attention": {"args": ASK}}, prompt="a cat", steps=STEPS,
                    sd_model=raises)
    assert not panel._open and layers.get_layer("generation") is None     # it ended where it raised
    assert a1111_sdp_in_place() and not a1111._lends

    shared.opts.set("cross_attention_optimization", AUTO_TITLE)           # Settings → Apply (redo_hijack)
    from modules import sd_hijack
    assert sd_hijack.current_optimizer.name == "attn-auto"
    generate(runner, ["sdpa"])
    report = readout.last_report()
    assert report.backends("unet") == [("sdpa", STEPS * CALLS_PER_MODEL_CALL)] and report.ran_on is None
    assert a1111.patches.active and a1111.patches.intact() and detect.routing().routed


def test_a_stale_generations_end_takes_back_only_its_own_lend(webui_factory):
    """A generation left open (its ``postprocess`` never came, and nothing saw it end) that lent the
    forwards; then the user chooses the extension's entry: the stale generation's end, at the next job,
    leaves the entry's forwards in force."""
    runner, base, refiner = launch(webui_factory)
    from modules import processing, sd_hijack, shared
    stale = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    shared.state.begin()
    panel.process(stale, *ASK)
    assert panel._open and detect.routing().routed and a1111._lends
    shared.opts.set("cross_attention_optimization", AUTO_TITLE)
    assert sd_hijack.current_optimizer.name == "attn-auto" and a1111.patches.intact()
    generate(runner, ["sdpa"])                                          # closes the stale one first
    assert not panel._open and not a1111._lends
    assert a1111.patches.active and a1111.patches.intact() and detect.routing().routed
    assert readout.last_report().backends("unet") == [("sdpa", STEPS * CALLS_PER_MODEL_CALL)]


def test_an_xyz_cell_that_raises_ends_at_once_and_the_next_cell_lends_again(webui_factory):
    runner, base, refiner = launch(webui_factory)
    from modules import processing, shared
    from modules.api import api
    default_args = api.init_script_args({"Flash Attention": {"args": ASK}}, api.init_default_script_args(runner),
                                        runner)

    def cell(model):
        p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat", steps=STEPS, sd_model=model)
        p.scripts, p.script_args = runner, tuple(default_args)
        try:
            return processing.process_images(p)
        except Exception:            # the grid script shows the error and goes on with the next cell
            return None

    def raises(p):
        raise RuntimeError("cell failed")

    shared.state.begin(job="xyz")    # one job for every cell
    try:
        assert cell(raises) is None
        assert not panel._open and not a1111._lends and a1111_sdp_in_place()
        assert layers.get_layer("generation") is None
        processed = cell(sampling_model.generation("a1111", []))
    finally:
        shared.state.end()
    assert unet_fallbacks(processed.infotexts[0]) == f"flash-attn ×{STEPS * CALLS_PER_MODEL_CALL}"
    assert not panel._open and a1111_sdp_in_place()


def test_two_api_jobs_within_one_second_are_two_jobs(webui_factory):
    """A1111 stamps a job to the second: a generation of the job before, left open, is closed by the next
    job's even with the same stamp (its VRAM polling thread and layer with it)."""
    runner, base, refiner = launch(webui_factory)
    from modules import processing, shared
    first = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    shared.state.begin()
    shared.state.job_timestamp = "20261206040000"
    panel.process(first, *ASK)
    gen = panel._open[-1]
    shared.state.begin()
    shared.state.job_timestamp = "20261206040000"
    second = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    panel.process(second, *ASK)
    assert [g.p for g in panel._open] == [second]
    assert gen.probe is None or gen.probe._thread is None          # its polling stopped with it
    panel.postprocess(second, processing.Processed(second, []))
    assert not panel._open and not a1111._lends and a1111_sdp_in_place()
