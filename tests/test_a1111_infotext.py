"""Infotext as users meet it in A1111 1.10 and Forge: one per image, pasted back (↙, PNG Info), sent to
the other tab, and a request's ``override_settings``, through the doubles of ``processing`` (the batch
loop in A1111's order), ``infotext_utils`` (parsing, the paste button, "Send to") and the API.

The UI is built as A1111's ``ui.py`` builds it: per tab a prompt, the scripts' UI, the tab's paste
fields (its own and every script's ``infotext_fields``), the paste button; under txt2img's images the
"Send to img2img" button with the scripts' ``paste_field_names``.
"""
import pytest
import torch

gr = pytest.importorskip("gradio")

import lib_attn  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.test_generation import AUTO_TITLE, _clean, sample  # noqa: E402,F401
from webui_attn.routing import detect  # noqa: E402
from webui_attn.settings import stored  # noqa: E402
from webui_attn.ui import panel, readout  # noqa: E402
from webui_attn.ui.readout import parse_infotext  # noqa: E402

MODES = ("a1111", "forge")


class Tabs:
    """txt2img and img2img as ``ui.py`` builds them."""

    def __init__(self, mode):
        from modules import infotext_utils as iu
        from modules import script_callbacks, scripts, sd_hijack
        if mode == "a1111":
            sd_hijack.model_hijack.apply_optimizations(AUTO_TITLE)
        script_callbacks.ui_settings_callback()
        iu.reset()
        self.runners = {"txt2img": scripts.scripts_txt2img, "img2img": scripts.scripts_img2img}
        self.prompt, self.paste, self.fields = {}, {}, {}
        with gr.Blocks() as self.demo:
            for tab, runner in self.runners.items():
                runner.initialize_scripts(tab == "img2img")
                self.prompt[tab] = gr.Textbox(label="Prompt")
                steps = gr.Slider(label="Sampling steps", value=20)
                self.paste[tab] = gr.Button("↙")
                runner.setup_ui()
                fields = [iu.PasteField(self.prompt[tab], "Prompt", api="prompt"),
                          iu.PasteField(steps, "Steps", api="steps"), *runner.infotext_fields]
                iu.add_paste_fields(tab, None, fields, None)
                iu.register_paste_params_button(iu.ParamBinding(paste_button=self.paste[tab], tabname=tab,
                                                                source_text_component=self.prompt[tab]))
                self.fields[tab] = fields
            self.send_button = gr.Button("Send to img2img")
            iu.register_paste_params_button(iu.ParamBinding(
                paste_button=self.send_button, tabname="img2img", source_tabname="txt2img",
                paste_field_names=self.runners["txt2img"].paste_field_names))
            iu.connect_paste_params_buttons()

    def script(self, tab="txt2img"):
        return self.runners[tab].alwayson_scripts[0]

    def controls(self, tab="txt2img"):
        return self.script(tab).controls

    def _event(self, trigger):
        for dep, fn in zip(self.demo.dependencies, self.demo.fns):
            if fn.fn is not None and trigger._id in [t if isinstance(t, int) else t[0] for t in dep["targets"]]:
                return fn.fn, [self.demo.blocks[i] for i in dep["inputs"]], [self.demo.blocks[i] for i in dep["outputs"]]
        raise AssertionError("no event handler on the component")

    def paste_text(self, text, tab="txt2img"):
        """The paste button with ``text`` in the prompt box: {component: the update it gets}."""
        fn, _, outputs = self._event(self.paste[tab])
        return dict(zip(outputs, fn(text)))

    def send_to_img2img(self, values: dict):
        """"Send to img2img" with txt2img's components holding ``values``: {img2img component: value}."""
        fn, inputs, outputs = self._event(self.send_button)
        return dict(zip(outputs, fn(*(values.get(c, c.value) for c in inputs)))), inputs


def pasted(updates: dict, component):
    """The value an update sets, or None when it leaves the field as it is."""
    update = updates[component]
    return update.get("value") if "value" in update else None


def batches_model(fallbacks_per_batch):
    """Sampling and decoding per batch: A1111's patched ldm modules (``sample``), then in batch n
    ``fallbacks_per_batch[n]`` calls that prefer flash-attn, which cannot run on CPU and falls back."""
    def model(p):
        sample(p)
        with torch.no_grad(), lib_attn.use(preference={"unet": ["flash-attn", "sdpa"]}):
            for _ in range(fallbacks_per_batch[p.iteration]):
                denoiser_call()
    return model


def denoiser_call():
    """One UNet attention call through the host's own module (A1111's patched ldm CrossAttention; Forge's
    rebound ``backend.nn.unet.attention_function``)."""
    if detect.detect() == detect.FORGE:
        import backend.nn.unet as unet
        q = torch.randn(1, 16, 320)
        unet.attention_function(q, q, q, 8)
        return
    import ldm.modules.attention as ldm_attention
    ldm_attention.CrossAttention(320, None, 8, 40)(torch.randn(1, 16, 320))


def txt2img(tabs, args=None, **kwargs):
    from modules.api import api
    alwayson = None if args is None else {"Flash Attention": {"args": args}}
    return api.txt2img(tabs.runners["txt2img"], alwayson_scripts=alwayson, prompt="a cat", **kwargs)


def ui_generation(tabs, args, **kwargs):
    """A txt2img generation from the UI: the script's values as the accordion holds them, a grid."""
    from modules import processing, shared
    runner = tabs.runners["txt2img"]
    p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat", **kwargs)
    p.scripts = runner
    p.script_args = tuple([0] + list(args))
    shared.state.begin(job="task(1)")
    try:
        return processing.process_images(p)
    finally:
        shared.state.end()


# --- 4: each image's infotext counts its own batch -------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_batch_count_three_gives_three_infotexts_with_their_own_counts(webui_factory, mode):
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    processed, info = txt2img(tabs, n_iter=3, sd_model=batches_model([0, 1, 2]))
    per_image = [parse_infotext(text) for text in info["infotexts"]]
    assert len(per_image) == 3                                     # the API returns no grid
    assert [p.get("Attention fallbacks", "").split(":")[0] for p in per_image] == ["", "flash-attn ×1",
                                                                                    "flash-attn ×2"]
    assert all(p["Attention"].startswith("sdpa") for p in per_image)
    # the whole job, where the webui keeps one value for all images: the readout and extra_generation_params
    whole = info["extra_generation_params"]["Attention fallbacks"]
    assert whole.startswith("flash-attn ×3: ")
    assert readout.last_report().fallbacks and sum(readout.last_report().fallbacks.values()) == 3


@pytest.mark.parametrize("mode", MODES)
def test_images_of_one_batch_share_its_counts_and_the_grid_counts_the_job(webui_factory, mode):
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    processed = ui_generation(tabs, ["use setting", "use setting", ""], n_iter=2, batch_size=2,
                              sd_model=batches_model([2, 0]))
    grid, *images = [parse_infotext(text) for text in processed.infotexts]
    assert processed.index_of_first_image == 1 and len(images) == 4
    assert [p.get("Attention fallbacks", "").split(":")[0] for p in images] == ["flash-attn ×2"] * 2 + [""] * 2
    assert grid["Attention fallbacks"].startswith("flash-attn ×2: ")    # the job's: batch 0's two, batch 1 none


def fallbacks(n):
    with torch.no_grad(), lib_attn.use(preference={"unet": ["flash-attn", "sdpa"]}):
        for _ in range(n):
            denoiser_call()


@pytest.mark.parametrize("mode", MODES)
def test_passes_before_the_first_batch_and_on_each_image_count_in_an_image(webui_factory, mode):
    """img2img's encoding of its init image runs before the first batch; an extension such as ADetailer
    runs a pass on each image in ``postprocess_image``, after its batch was decoded and before its
    infotext is written: both count in an image's infotext (the first batch's; the image's own batch)."""
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    from modules import processing, scripts, shared

    class Detailer(scripts.Script):   # a tiny extension of the test's own
        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def postprocess_image(self, p, pp, *args):
            fallbacks(5)

    runner = tabs.runners["txt2img"]
    detailer = Detailer()
    detailer.args_from = detailer.args_to = 0
    runner.alwayson_scripts.append(detailer)

    class Img2Img(processing.StableDiffusionProcessingTxt2Img):
        def init(self, all_prompts, all_seeds, all_subseeds):
            fallbacks(7)                 # the init image's encoding

    p = Img2Img(prompt="a cat", n_iter=2, batch_size=1, sd_model=batches_model([1, 2]))
    p.scripts, p.script_args = runner, (0, "use setting", "use setting", "")
    shared.state.begin(job="task(2)")
    try:
        processed = processing.process_images(p)
    finally:
        shared.state.end()
        runner.alwayson_scripts.remove(detailer)
    grid, first, second = [parse_infotext(text) for text in processed.infotexts]
    assert first["Attention fallbacks"].startswith("flash-attn ×13: ")     # encode 7, batch 1, its pass 5
    assert second["Attention fallbacks"].startswith("flash-attn ×7: ")     # batch 2, its pass 5
    assert grid["Attention fallbacks"].startswith("flash-attn ×20: ")      # the whole generation
    assert sum(readout.last_report().fallbacks.values()) == 20


@pytest.mark.parametrize("mode", MODES)
def test_a_generation_run_on_a_copy_of_p_inside_one_leaves_the_outer_images_their_own_counts(webui_factory, mode):
    """An extension that runs a generation of its own on each image (``process_images`` on ``copy(p)``, with
    the scripts, from ``postprocess_image``): A1111's ``p`` is a dataclass, so the copy shares its
    ``extra_generation_params`` and ``comments`` dicts. Each outer image still counts its batch and the pass
    run on it, and the nested generation's readout lines stay off the outer's comments."""
    import copy
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    from modules import processing, scripts, shared

    class Detailer(scripts.Script):   # a tiny extension of the test's own
        inside = False

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def postprocess_image(self, p, pp, *args):
            if Detailer.inside:
                return
            Detailer.inside = True
            try:
                nested = copy.copy(p)
                nested.n_iter, nested.sd_model = 1, batches_model([3])
                processing.process_images(nested)
            finally:
                Detailer.inside = False

    runner = tabs.runners["txt2img"]
    detailer = Detailer()
    detailer.args_from = detailer.args_to = 0
    runner.alwayson_scripts.append(detailer)
    shared.opts.set(stored.KEY_READOUT, True)
    p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat", n_iter=2, sd_model=batches_model([1, 2]))
    p.scripts, p.script_args = runner, (0, "use setting", "use setting", "")
    shared.state.begin(job="task(3)")
    try:
        processed = processing.process_images(p)
    finally:
        shared.state.end()
        runner.alwayson_scripts.remove(detailer)
    grid, first, second = [parse_infotext(text) for text in processed.infotexts]
    assert first["Attention fallbacks"].startswith("flash-attn ×4: ")      # batch 1, the pass on its image 3
    assert second["Attention fallbacks"].startswith("flash-attn ×5: ")     # batch 2, its pass 3
    assert grid["Attention fallbacks"].startswith("flash-attn ×9: ")
    assert sum(readout.last_report().fallbacks.values()) == 9
    attention_lines = [line for line in processed.comments.splitlines() if line.startswith("Attention: ")]
    assert len(attention_lines) == 1 and "×9" in processed.comments    # the outer generation's readout alone


# --- 3: paste-back restores what was chosen; "Send to" carries it -----------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_pasting_an_infotext_whose_kernel_fell_back_pins_nothing(webui_factory, mode):
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    from modules import shared
    shared.opts.set(stored.KEY_BACKEND, "flash-attn")            # the Settings backend; it cannot run on CPU
    processed, info = txt2img(tabs, sd_model=sample)
    text = info["infotexts"][0]
    params = parse_infotext(text)
    assert params["Attention"].startswith("sdpa") and params["Attention fallbacks"].startswith("flash-attn")
    override, guard, schedule = tabs.controls()[:3]
    updates = tabs.paste_text(text)
    assert pasted(updates, override) == "use setting"                 # never the fallback that ran
    assert pasted(updates, guard) == "use setting" and pasted(updates, schedule) == ""
    # a field pinned before is released by an infotext that chose nothing
    assert pasted(tabs.paste_text("a dog\nSteps: 20, Sampler: Euler a, Seed: 1"), override) == "use setting"


@pytest.mark.parametrize("mode", MODES)
def test_paste_and_params_txt_restore_the_choice_and_send_to_carries_it(webui_factory, mode):
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    chosen = ["sdpa-math", "full", "0-50%: sdpa; 50-100%: math"]
    processed = ui_generation(tabs, chosen, sd_model=sample)
    override, guard, schedule = tabs.controls()[:3]
    for text in (processed.infotexts[0], ""):          # the image's text; an empty prompt reads params.txt
        updates = tabs.paste_text(text)
        assert [pasted(updates, c) for c in (override, guard, schedule)] == chosen
    # "Send to img2img" copies txt2img's fields into img2img's, field by field
    sent, inputs = tabs.send_to_img2img(dict(zip(tabs.controls(), chosen)))
    assert [c for c in inputs if c in tabs.controls()] == list(tabs.controls())
    assert [sent[c] for c in tabs.controls("img2img")[:3]] == chosen


@pytest.mark.parametrize("mode", MODES)
def test_pasting_an_image_made_without_sparse_empties_the_sparse_field(webui_factory, mode):
    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    sparse_field = tabs.controls()[3]
    with_sparse = ui_generation(tabs, ["use setting", "use setting", "", "block-sparse, budget=0.2"],
                                sd_model=sample)
    text = with_sparse.infotexts[0]
    assert pasted(tabs.paste_text(text), sparse_field).startswith("block-sparse, budget=0.2")
    without = ui_generation(tabs, ["use setting", "use setting", "", ""], sd_model=sample)
    assert "Sparse attention" not in parse_infotext(without.infotexts[0])
    # the field holds the pasted settings: an image made without them empties it (its setting's then)
    assert pasted(tabs.paste_text(without.infotexts[0]), sparse_field) == ""
    assert pasted(tabs.paste_text("a dog\nSteps: 20, Sampler: Euler a, Seed: 1"), sparse_field) == ""


# --- 5: a request's override_settings last as long as the request ----------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("restore", [True, False])
def test_override_settings_apply_to_the_request_and_go_with_it(webui_factory, mode, restore):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from webui_attn.ui import api

    webui_factory(mode).load_scripts()
    tabs = Tabs(mode)
    from modules import script_callbacks, shared
    app = FastAPI()
    script_callbacks.app_started_callback(None, app)
    client = TestClient(app)
    before = client.get(api.ROUTE).json()["availability"]["chains"]
    assert before["unet"][0] != "sdpa-math"
    from modules import processing
    original = processing.StableDiffusionProcessing.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.override_settings_restore_afterwards = restore

    processing.StableDiffusionProcessing.__init__ = keep
    try:
        txt2img(tabs, sd_model=sample, override_settings={stored.KEY_BACKEND: "sdpa-math"})
    finally:
        processing.StableDiffusionProcessing.__init__ = original
    assert readout.last_report().backends("unet")[0][0] == "sdpa-math"        # applied for the request
    after = client.get(api.ROUTE).json()["availability"]["chains"]
    if restore:
        assert shared.opts.data[stored.KEY_BACKEND] == stored.AUTO
        assert after == before                                               # gone with it
    else:
        assert shared.opts.data[stored.KEY_BACKEND] == "sdpa-math"           # the webui kept it: so does the engine
        assert after["unet"][0] == "sdpa-math"
