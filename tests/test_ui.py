"""The UI builds inside a real gradio Blocks (A1111's gradio 3.41.2) and shows the engine's data."""
import html
import importlib.machinery
import json
import shutil
import subprocess
import sys

import pytest

gr = pytest.importorskip("gradio")

import lib_attn  # noqa: E402
from lib_attn.report import MIB, Report, Vram  # noqa: E402
from tests.ui_helpers import event_handler  # noqa: E402
from host_attn import status  # noqa: E402
from webui_attn.settings import choices  # noqa: E402
from webui_attn.ui import components  # noqa: E402
from lib_attn.device import cpu_model  # noqa: E402
from webui_attn.ui.api import XFORMERS_MISSING, availability, xformers_blocked  # noqa: E402


def _report():
    return Report(
        calls={("unet", "flash-attn"): 1260, ("vae", "sdpa-efficient"): 2},
        fallbacks={("vae", "flash-attn", "head_dim 512 > 256"): 2},
        kernels={"flash-attn": "flash-attn 2.8.3", "sdpa-efficient": "sdpa-efficient torch 2.3.1"},
        seconds=12.3,
        vram=Vram(3 * 1024 * MIB, 4 * 1024 * MIB, 6 * 1024 * MIB, 80 * 1024 * MIB),
    )


def _values(choices):
    return [c if isinstance(c, str) else c[1] for c in choices]


def test_accordion_builds_in_blocks_and_refreshes_the_readout():
    shown = {"report": None}
    with gr.Blocks() as demo:
        parts = components.accordion(False, lambda: shown["report"])

    override = parts["override"]
    assert isinstance(override, gr.Dropdown)
    assert override.value == choices.USE_SETTING
    assert _values(override.choices) == [choices.USE_SETTING, *lib_attn.BACKEND_IDS]
    assert override.elem_id == "flash_attn_txt2img_override"
    assert isinstance(parts["readout"], gr.HTML)
    assert "No generation yet" in parts["readout"].value

    fn, outputs = event_handler(demo, parts["refresh"])
    assert outputs == [parts["readout"]._id]
    assert "No generation yet" in fn()
    shown["report"] = _report()
    assert fn() == components.report_html(shown["report"])


#: Runs an event's ``js`` the way gradio's page does (an async function over the inputs and the outputs'
#: values; its result becomes the server call's inputs) for a list of texts, and prints, per call, the
#: inputs the server would get, or "skipped" when the promise is still unsettled after 100 ms.
_RUN_EVENT_JS = """
globalThis.window = globalThis;
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
const [sources, calls] = JSON.parse(process.argv[1]);
const fns = sources.map((js) => new AsyncFunction("__fn_args",
  `let result = await (${js})(...__fn_args); return !Array.isArray(result) ? [result] : result;`));
const outcome = (p) => Promise.race([p.then((v) => JSON.stringify(v)),
  new Promise((r) => setTimeout(() => r("skipped"), 100))]);
(async () => {
  const out = [];
  for (const [i, text] of calls) out.push(await outcome(fns[i]([text, "<div>readout</div>"])));
  console.log(JSON.stringify(out));
})();
"""


def _event_js(demo, trigger):
    for dep in demo.config["dependencies"]:
        if trigger._id in [t if isinstance(t, int) else t[0] for t in dep["targets"]]:
            return dep["js"]
    raise AssertionError("no event on the component")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's JavaScript")
def test_follow_asks_the_server_only_when_the_trigger_text_changes():
    # gradio 4 fires an HTML component's change on every re-render, and every server call re-renders:
    # the readout must not ask again for a text it already asked for.
    with gr.Blocks() as demo:
        logs, readouts = [], []
        for is_img2img in (False, True):
            parts = components.accordion(is_img2img, lambda: None, refresh=False)
            logs.append(gr.HTML(elem_id="html_log"))
            readouts.append(parts["readout"])
            components.follow(logs[-1], parts["readout"], lambda: _report())
    fn, outputs = event_handler(demo, logs[0])
    assert outputs == [readouts[0]._id] and fn("Time taken: 1 sec.") == components.report_html(_report())
    calls = [(0, ""), (0, ""), (0, "Time taken: 1 sec."), (0, "Time taken: 1 sec."), (1, "Time taken: 1 sec."),
             (1, "Time taken: 1 sec."), (0, "Time taken: 2 sec."), (0, "Time taken: 2 sec.")]
    sources = [_event_js(demo, log) for log in logs]
    run = subprocess.run(["node", "-e", _RUN_EVENT_JS, json.dumps([sources, calls])],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(run.stdout) == ['[""]', "skipped", '["Time taken: 1 sec."]', "skipped",
                                      '["Time taken: 1 sec."]', "skipped", '["Time taken: 2 sec."]', "skipped"]


def test_img2img_accordion_has_its_own_ids():
    with gr.Blocks():
        parts = components.accordion(True)
    assert parts["override"].elem_id == "flash_attn_img2img_override"


def test_readout_html_shows_counts_fallbacks_time_and_vram():
    text = components.report_html(_report())
    assert "<td class='flash-attn-kernel'>flash-attn 2.8.3</td><td class='flash-attn-count'>×1,260</td>" in text
    assert "<td class='flash-attn-role'>VAE</td>" in text
    assert "<code>flash-attn</code> passed over ×2: head_dim 512 &gt; 256" in text
    assert "Time: 12.3 sec." in text
    assert "A: 3.00 GB, R: 4.00 GB, Sys: 6.0/80 GB (7.5%)" in text


def test_readout_escapes_engine_text():
    report = Report(calls={("unet", "sdpa"): 1}, fallbacks={("unet", "sage", "<b>bad</b> & 'x'"): 1})
    text = components.report_html(report)
    assert "<b>bad</b>" not in text and html.escape("<b>bad</b> & 'x'", quote=True) in text


def test_availability_table_lists_every_backend_with_reason_or_version():
    data = availability()
    text = components.availability_html(data)
    for b in lib_attn.backends():
        row_start = text.index(f"<code>{b.id}</code>")
        row = text[row_start:text.index("</tr>", row_start)]
        if b.available:
            assert "✓" in row and html.escape(b.version, quote=True) in row
        else:
            assert "✗" in row and html.escape(b.reason, quote=True) in row
    device = lib_attn.device_info()
    if device.type == "cpu":   # the processor, not the machine's architecture
        assert f"<p>Device: CPU ({html.escape(cpu_model())}) · torch" in text
    else:
        assert html.escape(device.name) in text
    for role in ("unet", "dit", "vae"):
        label = components.ROLE_LABELS[role]
        assert f"<li>{label}: " + " → ".join(lib_attn.default_chain(role, device)) + "</li>" in text
    assert "Text encoder" not in text     # neither host sends its text encoder through the engine


def test_cpu_model_reads_the_processor_name():
    name = cpu_model()
    assert name and name != "x86_64"
    try:
        with open("/proc/cpuinfo") as f:
            listed = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        listed = []
    if listed:
        assert name == listed[0]


def test_xformers_blocked_by_the_webui_is_named_only_where_it_is_installed(monkeypatch, tmp_path):
    """A1111's import hook (and its descendants') puts None in sys.modules["xformers"] unless started with
    --xformers; where xformers is not installed at all, that is what the user needs to hear."""
    halted = "ModuleNotFoundError: import of xformers halted; None in sys.modules"
    infos = [lib_attn.BackendInfo(b.id, b.label, False, halted if b.id == "xformers" else "other", "")
             for b in lib_attn.backends()]
    monkeypatch.setattr(lib_attn, "backends", lambda: list(infos))
    monkeypatch.setitem(sys.modules, "xformers", None)
    if importlib.machinery.PathFinder.find_spec("xformers") is None:
        rows = {row["id"]: row for row in availability()["backends"]}
        assert rows["xformers"]["reason"] == XFORMERS_MISSING == "xformers is not installed"
    (tmp_path / "xformers").mkdir()
    (tmp_path / "xformers" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))                      # installed, and blocked
    rows = {row["id"]: row for row in availability()["backends"]}
    assert rows["xformers"]["reason"] == f"{xformers_blocked('the webui')} ({halted})"
    assert "unless it is started with --xformers" in rows["xformers"]["reason"]
    assert rows["sdpa"]["reason"] == "other"
    monkeypatch.delitem(sys.modules, "xformers")      # not blocked (another cause): the engine's text alone
    assert {r["id"]: r for r in availability()["backends"]}["xformers"]["reason"] == halted


def test_availability_data_matches_the_engine():
    data = availability()
    assert [b["id"] for b in data["backends"]] == list(lib_attn.BACKEND_IDS)
    for row, info in zip(data["backends"], lib_attn.backends()):
        assert row["available"] == info.available
        assert row["reason"] == (info.reason or None)
    assert data["device"]["type"] == lib_attn.device_info().type


def test_override_choices_label_unavailable_backends_in_pairs():
    pairs = choices.override_choices(pairs=True)
    assert pairs[0] == (choices.USE_SETTING, choices.USE_SETTING)
    for (label, value), info in zip(pairs[1:], lib_attn.backends()):
        assert value == info.id
        assert label == (info.id if info.available else f"{info.id} — {status.short_reason(info)}")
        assert len(label) <= len("sdpa-efficient — not in this torch")   # fits the dropdown; reasons go elsewhere
        assert choices.backend_from_choice(label) == info.id              # what script-info lists is accepted back


@pytest.mark.parametrize("value,expected", [
    ("sdpa", "sdpa"), (" sdpa-math ", "sdpa-math"),
    ("flash-attn (unavailable)", "flash-attn"),
    ("flash-attn — unavailable: ModuleNotFoundError: No module named 'flash_attn'", "flash-attn"),
    ("nonexistent", None), ("m", None), ("flash-attnx", None), ("sdpa fast", None), (123, None), (None, None),
    (["sdpa"], None),
])
def test_backend_from_choice(value, expected):
    assert choices.backend_from_choice(value) == expected
