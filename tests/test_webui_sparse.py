"""Sparse attention's flag, setting and layers in the webuis (A1111 1.10 and the Forge lines share them):
``--attn-sparse``, ``flash_attn_sparse``, the ``generation`` layer over both; bad values named and not
applied."""
import types

import pytest

import lib_attn
from tests.test_preload import parser_with_flags
from webui_attn.settings import flags, layers, stored

SETTINGS = "block-sparse, budget=0.2, min_tokens=4096"
CANONICAL = "block-sparse, budget=0.2, min_tokens=4096, topk=0.2, dense=0-20%; first 1"


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
