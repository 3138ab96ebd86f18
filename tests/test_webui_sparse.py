"""Sparse attention's flag, setting and layers in the webuis (A1111 1.10 and the Forge lines share them):
``--attn-sparse``, ``flash_attn_sparse``, the ``generation`` layer over both; bad values named and not
applied."""
import html
import types

import torch

import pytest

import lib_attn
from tests.test_preload import parser_with_flags
from webui_attn.settings import flags, layers, stored

SETTINGS = "block-sparse, budget=0.2, min_tokens=4096"
CANONICAL = "block-sparse, budget=0.2, min_tokens=4096, topk=0.1, dense=0-20%; first 1"


@pytest.fixture(autouse=True)
def fresh():
    layers.reset()
    yield
    layers.reset()
    lib_attn.reset()


def test_the_flag_parses_and_becomes_the_flags_layer():
    args = parser_with_flags().parse_args(["--attn-sparse", SETTINGS])
    assert args.attn_sparse == SETTINGS
    assert flags.problems(args) == []
    assert flags.apply(args) == {"sparse": SETTINGS}
    assert lib_attn.config().sparse.text == CANONICAL
    assert parser_with_flags().parse_args([]).attn_sparse is None


@pytest.mark.parametrize("value,said", [
    ("sol, budget=0", "sparse budget '0' is outside (0, 1]"),
    ("sol, budget=1.01", "sparse budget '1.01' is outside (0, 1]"),
    ("sol, budget=lots", "sparse budget 'lots' is not a number"),
    ("flex", "sparse method 'flex' is not one of auto, sol, block-sparse"),
    ("block-sparse, min_tokens=0", "sparse min_tokens '0' must be a whole number >= 1"),
])
def test_a_bad_flag_is_named_and_ignored(value, said):
    args = types.SimpleNamespace(attn_sparse=value)
    (message,) = flags.problems(args)
    assert message.startswith(f"--attn-sparse: {said}") and message.endswith(". The flag is ignored."), message
    assert flags.apply(args) is None and lib_attn.config().sparse is None


def test_the_setting_overrides_the_flag_and_off_turns_it_off():
    flags.apply(types.SimpleNamespace(attn_sparse="sol, budget=0.3"))
    assert lib_attn.config().sparse.method == "sol"
    stored.apply_settings(types.SimpleNamespace(flash_attn_sparse=SETTINGS))
    assert lib_attn.config().sparse.text == CANONICAL
    stored.apply_settings(types.SimpleNamespace(flash_attn_sparse="off"))
    assert lib_attn.config().sparse is None
    stored.apply_settings(types.SimpleNamespace(flash_attn_sparse=""))                 # empty: the flag's
    assert lib_attn.config().sparse.method == "sol"
    layers.set_layer("generation", {"sparse": "off"})                                  # a generation's own
    assert lib_attn.config().sparse is None


def test_a_bad_setting_is_named_not_applied_and_kept_as_the_user_wrote_it():
    values = dict(stored.DEFAULTS, flash_attn_sparse="sol, min_tokens=-5")
    problem = stored.setting_sparse_problem(values)
    assert problem.startswith("setting flash_attn_sparse: sparse min_tokens '-5' must be a whole number >= 1")
    assert "generations that leave sparse attention to the setting are refused" in problem
    assert problem in stored.problems(values)
    assert stored.layer_from(values) is None
    assert stored.setting_sparse_problem(dict(stored.DEFAULTS, flash_attn_sparse=SETTINGS)) is None


# --- a generation, through each host's double --------------------------------------------------------

gr = pytest.importorskip("gradio")

from tests.doubles.fixtures import webui_factory  # noqa: E402,F401
from tests.test_generation import prefixed  # noqa: E402
from tests.test_webui_schedule import MODES, generate, launch  # noqa: E402
from webui_attn.ui import components, readout  # noqa: E402
from webui_attn.ui.readout import parse_infotext  # noqa: E402

LONG_ONLY = "block-sparse, budget=0.2, min_tokens=100000"   # every call of the small model is shorter


@pytest.mark.parametrize("mode", MODES)
def test_sparse_for_one_generation_is_recorded_pasted_back_and_below_its_minimum_changes_nothing(webui_factory,
                                                                                                 mode):
    runner = launch(webui_factory, mode)
    _, _, plain = generate(runner, mode)
    processed, info, sparse = generate(runner, mode, ["use setting", "use setting", "", LONG_ONLY])
    canonical = LONG_ONLY + ", topk=0.1, dense=0-20%; first 1"
    assert parse_infotext(processed.info)["Sparse attention"] == canonical
    assert info["extra_generation_params"]["Sparse attention"] == canonical
    for part in (0, 1):                                     # the latent, the VAE's output: the same, bit for bit
        assert torch.equal(plain[0][part], sparse[0][part])
    assert lib_attn.config().sparse is None                 # over with the generation
    script = runner.alwayson_scripts[0]
    field, reader = script.infotext_fields[3]
    assert field is script.controls[3] and reader in script.paste_field_names   # "Send to" carries it
    assert reader(parse_infotext(processed.info)) == canonical
    assert reader(parse_infotext("a cat\nSteps: 10, Sparse attention: \"radial, budget=2\"")) is None
    assert reader(parse_infotext(processed.info.replace("Sparse attention", "Other"))) == ""   # made without


def test_sparse_that_did_not_apply_is_not_recorded_and_pasting_the_image_empties_the_field(webui_factory):
    """A1111's own sdp chosen by name: the generation does not go through the extension, so its sparse
    settings do not apply; the infotext says so in its note and carries no ``Sparse attention`` that a paste
    (or the API's infotext) would turn on."""
    from tests import sampling_model
    from tests.test_generation import start
    runner, _, _ = start(webui_factory, "a1111", optimization="sdp - scaled dot product")
    from modules import shared
    shared.sd_model = sampling_model.build("a1111")
    processed, info, _ = generate(runner, "a1111", ["use setting", "use setting", "", LONG_ONLY])
    params = parse_infotext(processed.info)
    assert "Sparse attention" not in params and "Sparse attention" not in info["extra_generation_params"]
    assert "sparse attention 'block-sparse, budget=0.2, min_tokens=100000" in params["Attention note"]
    assert "not applied: attention runs on A1111's sdp optimizer" in params["Attention note"]
    reader = runner.alwayson_scripts[0].infotext_fields[3][1]
    assert reader(params) == ""


@pytest.mark.parametrize("mode", ("a1111", "neo"))
def test_bad_sparse_settings_for_a_generation_refuse_it_naming_the_value(webui_factory, capsys, mode):
    runner = launch(webui_factory, mode)
    capsys.readouterr()
    processed, _, outputs = generate(runner, mode, ["use setting", "use setting", "", "sol, budget=3"])
    assert outputs == []                                    # stopped before sampling
    (note,) = readout.last_report().notes
    assert note.startswith("generation refused: sparse attention for this generation: sparse budget '3' is "
                           "outside (0, 1]")
    assert f"Attention note: {note}" in processed.comments
    assert any("sparse budget '3'" in line for line in prefixed(capsys.readouterr().out))
    assert layers.get_layer("generation") is None and lib_attn.config().sparse is None
    generate(runner, mode)                                  # the next request runs
    assert readout.last_report().backends("unet")


def test_a_bad_sparse_setting_refuses_generations_that_leave_it_to_the_setting(webui_factory):
    runner = launch(webui_factory, "forge")
    from modules.api import api
    api.set_config({stored.KEY_SPARSE: "block-sparse, min_tokens=0"})
    assert layers.get_layer("settings") is None
    _, _, outputs = generate(runner, "forge")
    assert outputs == [] and readout.last_report().notes[-1].startswith(
        f"generation refused: setting {stored.KEY_SPARSE}: sparse min_tokens '0' must be a whole number >= 1")
    _, _, outputs = generate(runner, "forge", ["use setting", "use setting", "", "off"])  # none for this one
    assert len(outputs) == 1


def test_the_readout_says_what_sparse_attention_did():
    """A long local-structure self-attention call runs sparse: the readout under the image has the calls,
    the blocks kept and the error measured against the budget, and the call kind."""
    from lib_attn.commands.bench.inputs import local_inputs
    from lib_attn.report import Report
    from webui_attn.ui import readout
    lib_attn.configure(sparse="block-sparse, budget=0.15, min_tokens=1024, dense=none")
    q, k, v = local_inputs(1, 2, (4, 16, 32), 32, torch.float32, torch.device("cpu"), seed=1)
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="unet")
    lines = readout.lines(Report.from_recording(rec))
    sparse = rec.sparse
    head = next(line for line in lines if line.startswith("sparse ×1 (block-sparse, budget=0.15"))
    assert f"blocks kept {sparse.kept_share():.0%}" in head and f"error max {sparse.error_max():.1e}" in head
    assert any(line.startswith("sparse UNet block-sparse any at ") for line in lines), lines


@pytest.mark.parametrize("mode", ("a1111", "reforge"))
def test_the_readout_counts_what_stayed_dense_and_why(webui_factory, mode):
    runner = launch(webui_factory, mode)
    processed, _, _ = generate(runner, mode, ["use setting", "use setting", "", LONG_ONLY])
    report = readout.last_report()
    assert report.sparse is not None and report.sparse.calls == 0
    dense = dict(report.sparse.dense_items())
    assert dense and all(reason.startswith("below min_tokens: ") or reason in ("cross-attention", "vae calls stay dense")
                         for (_, reason) in dense)
    (line,) = [x for x in readout.lines(report) if x.startswith("dense while sparse was on: ")]
    assert "below min_tokens: " in line and line in processed.comments
    assert "dense while sparse was on" in html.unescape(components.report_html(report))
