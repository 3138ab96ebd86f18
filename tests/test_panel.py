"""Settings, per-generation override, readout, infotext and API route, through the webui doubles.

Each test loads ``scripts/flash_attention.py`` into an A1111 or Forge double and drives one generation
the way the webui does: ``process`` → sampling (real engine calls on CPU) → infotext → ``Processed`` →
``postprocess``.
"""
import re
import threading

import pytest
import torch

gr = pytest.importorskip("gradio")

import lib_attn  # noqa: E402
from lib_attn.report import Report  # noqa: E402
from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from webui_attn.settings import layers, stored  # noqa: E402
from webui_attn.ui import panel, settings_page  # noqa: E402
from webui_attn.ui import readout  # noqa: E402
from webui_attn.ui.readout import lines, parse_infotext, to_infotext  # noqa: E402

MODES = ("a1111", "forge")


@pytest.fixture(autouse=True)
def _clean():
    lib_attn.reset()
    panel.reset()
    yield
    panel.reset()
    layers.reset()
    lib_attn.reset()


def _load(webui_factory, mode):
    """The webui with this extension in the path: on A1111 its "attn-auto" entry applied, as a model load does."""
    webui = webui_factory(mode)
    webui.load_scripts()
    if mode == "a1111":
        from modules import sd_hijack
        from webui_attn.routing import a1111
        sd_hijack.model_hijack.apply_optimizations(a1111.ENTRY_BY_KEY["auto"].title)
    classes = webui.script_classes()
    assert classes, "the entry script did not load"
    script = classes[0]()
    return webui, script


def _settings_registered():
    from modules import script_callbacks, shared
    script_callbacks.ui_settings_callback()
    return shared.opts


UNET_QKV = [torch.randn(2, 4, 32, 40) for _ in range(3)]
VAE_QKV = [torch.randn(1, 1, 64, 512) for _ in range(3)]


def _sample(unet_calls=6, vae_calls=1):
    """What sampling and decoding do to attention: UNet calls, then VAE calls."""
    for _ in range(unet_calls):
        lib_attn.attention(*UNET_QKV, role="unet")
    for _ in range(vae_calls):
        lib_attn.attention(*VAE_QKV, role="vae")


def _generate(script, *args, unet_calls=6, vae_calls=1, thread=False):
    """One generation as processing.process_images runs it; on ``thread`` all of it runs on a worker
    thread, as Forge runs generations. Returns (p, processed, infotext written for the image)."""
    from modules import processing
    p = processing.StableDiffusionProcessingTxt2Img(prompt="a cat")
    out = {}

    def run():
        script.process(p, *args)
        _sample(unet_calls, vae_calls)
        out["infotext"] = processing.create_infotext(p, index=0)
        processed = processing.Processed(p, [], info=out["infotext"])
        script.postprocess(p, processed, *args)
        out["processed"] = processed

    if thread:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    return p, out["processed"], out["infotext"]


@pytest.mark.parametrize("mode", MODES)
def test_settings_live_in_optimizations_with_one_prefix(webui_factory, mode):
    _load(webui_factory, mode)
    opts = _settings_registered()
    ours = {k: v for k, v in opts.data_labels.items() if k.startswith(stored.PREFIX)}
    assert set(ours) == set(stored.DEFAULTS) | {stored.KEY_AVAILABILITY}
    assert {info.section for info in ours.values()} == {("optimizations", "Optimizations")}
    assert {info.category_id for info in ours.values()} == {"sd"}
    for key, default in stored.DEFAULTS.items():
        assert getattr(opts, key) == default
    assert ours[stored.KEY_AVAILABILITY].do_not_save


@pytest.mark.parametrize("mode", MODES)
def test_setting_components_build_in_blocks(webui_factory, mode):
    """Each option builds its component the way the settings page does, inside a real Blocks."""
    _load(webui_factory, mode)
    opts = _settings_registered()
    built = {}
    with gr.Blocks():
        for key, info in opts.data_labels.items():
            if not key.startswith(stored.PREFIX):
                continue
            args = info.component_args() if callable(info.component_args) else (info.component_args or {})
            component = info.component or gr.Textbox
            built[key] = component(label=info.label, value=opts.data.get(key, info.default),
                                   elem_id=f"setting_{key}", **args)
    backend = built[stored.KEY_BACKEND]
    assert isinstance(backend, gr.Dropdown)
    values = [c if isinstance(c, str) else c[1] for c in backend.choices]
    assert values == [stored.AUTO, *lib_attn.BACKEND_IDS]  # unavailable ones are listed too
    # ...and what cannot run here, grouped by cause, in the info line gradio draws under the dropdown
    from host_attn import status
    assert backend.info.endswith(status.unavailable_text(status.WEBUI_INSTALL_HINT))
    for b in lib_attn.backends():
        if not b.available and b.id not in status.SITUATIONAL:   # each named there
            assert re.search(rf"(?<![\w-]){re.escape(b.id)}(?![\w-])", backend.info), b.id
    # gradio's own info line on every setting that has one, none left to the hosts' settings script,
    # which cannot place it under a gradio 4 dropdown (Forge) and would draw it twice on A1111
    for key in (stored.KEY_BACKEND, stored.KEY_VAE_BACKEND, stored.KEY_FP32):
        assert built[key].info == settings_page.INFO[key]()
        assert not opts.data_labels[key].comment_after
    assert built[stored.KEY_VAE_BACKEND].info.startswith("The VAE attends")
    table = built[stored.KEY_AVAILABILITY]
    assert isinstance(table, gr.HTML)
    assert all(f"<code>{b}</code>" in table.value for b in lib_attn.BACKEND_IDS)


@pytest.mark.parametrize("mode", MODES)
def test_changed_setting_applies_to_the_next_generation(webui_factory, mode):
    _, script = _load(webui_factory, mode)
    opts = _settings_registered()
    assert opts.set(stored.KEY_BACKEND, "sdpa-math")           # onchange pushes it at once
    assert lib_attn.config().preference["unet"] == ("sdpa-math",)
    _, _, infotext = _generate(script, "use setting")
    ran = readout.last_report()
    assert ran.backends("unet") == [("sdpa-math", 6)]

    opts.data[stored.KEY_BACKEND] = stored.AUTO                # e.g. config.json edited, no onchange
    opts.data[stored.KEY_VAE_BACKEND] = "math"
    _generate(script, "use setting")
    ran = readout.last_report()
    auto = lib_attn.explain(*UNET_QKV, role="unet").backend
    assert ran.backends("unet") == [(auto, 6)]
    assert ran.backends("vae") == [("math", 1)]


@pytest.mark.parametrize("mode", MODES)
def test_override_applies_to_one_generation_only(webui_factory, mode):
    _, script = _load(webui_factory, mode)
    opts = _settings_registered()
    opts.set(stored.KEY_VAE_BACKEND, "sdpa-math")
    before = lib_attn.config()
    _, _, infotext = _generate(script, "math")
    ran = readout.last_report()
    assert ran.backends("unet") == [("math", 6)]
    assert ran.backends("vae") == [("sdpa-math", 1)]               # the VAE keeps its setting
    assert layers.get_layer("generation") is None
    assert lib_attn.config() == before
    assert parse_infotext(infotext)["Attention"].startswith(ran.describe("math") + "; VAE ")


@pytest.mark.parametrize("mode", MODES)
def test_readout_under_the_image_and_infotext(webui_factory, mode):
    _, script = _load(webui_factory, mode)
    _settings_registered()
    p, processed, infotext = _generate(script, "flash-attn", unet_calls=5, thread=(mode == "forge"))
    report = readout.last_report()
    assert sum(report.calls.values()) == 6
    unavailable = {b.id: b for b in lib_attn.backends()}["flash-attn"]
    if not unavailable.available:  # CPU: flash-attn passed over for every UNet call, with its reason
        assert report.fallbacks == {("unet", "flash-attn", "not available: " + unavailable.reason): 5}
    shown = lines(report)
    assert processed.comments.splitlines()[-len(shown):] == shown
    assert list(p.comments)[-len(shown):] == shown
    params = parse_infotext(infotext)
    assert params["Attention"] == to_infotext(report)["Attention"]
    if report.fallbacks:
        assert params["Attention fallbacks"] == to_infotext(report)["Attention fallbacks"]


def test_readout_can_be_turned_off(webui_factory):
    _, script = _load(webui_factory, "a1111")
    opts = _settings_registered()
    opts.set(stored.KEY_READOUT, False)
    p, processed, infotext = _generate(script, "use setting")
    assert processed.comments == "" and not p.comments
    assert "Attention: " in infotext  # the PNG still records what ran


def test_counters_are_per_generation(webui_factory):
    _, script = _load(webui_factory, "forge")
    _settings_registered()
    _generate(script, "use setting", unet_calls=4, vae_calls=1, thread=True)
    lib_attn.attention(*UNET_QKV)  # between generations: belongs to neither
    _generate(script, "use setting", unet_calls=2, vae_calls=0, thread=True)
    report = readout.last_report()
    assert sum(report.calls.values()) == 2 and report.roles() == ["unet"]


def test_generation_that_raised_does_not_leak_into_the_next(webui_factory):
    _, script = _load(webui_factory, "a1111")
    _settings_registered()
    from modules import processing, shared
    shared.state.job_timestamp = "20261202175000"   # set by the webui when each job begins
    broken = processing.StableDiffusionProcessingTxt2Img()
    script.process(broken, "math")         # sampling raised: postprocess never comes
    _sample(3, 0)
    shared.state.job_timestamp = "20261202175003"   # the next job
    _generate(script, "use setting", unet_calls=2, vae_calls=0)
    report = readout.last_report()
    auto = lib_attn.explain(*UNET_QKV, role="unet").backend
    assert report.backends("unet") == [(auto, 2)]       # neither the old override nor its counts
    assert layers.get_layer("generation") is None


@pytest.mark.parametrize("mode", MODES)
def test_paste_back_restores_what_was_chosen_never_what_ran(webui_factory, mode):
    _, script = _load(webui_factory, mode)
    _settings_registered()
    with gr.Blocks():
        components = script.ui(False)
    override, guard, schedule, sparse = components
    assert isinstance(override, gr.Dropdown) and override.value == "use setting"
    assert script.infotext_fields == list(zip(components, panel.PASTE_READERS))
    assert script.paste_field_names == list(panel.PASTE_READERS)   # "Send to" matches fields by these
    assert panel.PASTE_READERS[3] is panel.sparse_from_params
    read_override, read_guard, read_schedule = panel.PASTE_READERS[:3]

    _, _, infotext = _generate(script, "sdpa-math", "full")
    params = parse_infotext(infotext)
    assert params["Attention"].startswith("sdpa-math") and params["Attention override"] == "sdpa-math"
    assert params["Attention guard override"] == "full"
    assert (read_override(params), read_guard(params), read_schedule(params)) == ("sdpa-math", "full", "")
    _generate(script, read_override(params))
    assert readout.last_report().backends("unet") == [("sdpa-math", 6)]

    # left to the setting: what ran is recorded, nothing is chosen, and pasting pins nothing
    _, _, infotext = _generate(script, "use setting")
    params = parse_infotext(infotext)
    assert params["Attention"] and "Attention override" not in params and "Attention guard override" not in params
    assert (read_override(params), read_guard(params), read_schedule(params)) == ("use setting", "use setting", "")
    # an infotext of another tool, or of an earlier version (only what ran), pins nothing either
    for text in ("a dog\nSteps: 20, Sampler: Euler a, Seed: 1", "a dog\nSteps: 20, Seed: 1, Attention: sdpa"):
        assert read_override(parse_infotext(text)) == read_guard(parse_infotext(text)) == "use setting"
    assert read_override({"Attention override": "fastest"}) == "use setting"     # names no backend


@pytest.mark.parametrize("mode", MODES)
def test_api_route_returns_availability_and_last_report(webui_factory, mode):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from webui_attn.ui import api

    _, script = _load(webui_factory, mode)
    _settings_registered()
    from modules import script_callbacks
    app = FastAPI()
    script_callbacks.app_started_callback(None, app)
    script_callbacks.app_started_callback(None, app)      # "Reload UI" on the same app: one route
    assert [r.path for r in app.routes].count(api.ROUTE) == 1
    client = TestClient(app)

    empty = client.get(api.ROUTE)
    assert empty.status_code == 200 and empty.json()["last_report"] is None
    assert empty.json()["routing"] == {"routed": True, "ran_on": None, "hint": None}
    assert [b["id"] for b in empty.json()["availability"]["backends"]] == list(lib_attn.BACKEND_IDS)

    _generate(script, "sdpa-math")
    body = client.get(api.ROUTE).json()
    assert body["last_report"] == readout.to_json(readout.last_report())
    assert Report.from_dict(body["last_report"]).backends("unet") == [("sdpa-math", 6)]
    assert body["availability"] == api.availability()
    assert client.post(api.ROUTE).status_code == 405    # read-only
