"""preload.py flags, and how webui_attn.flags turns them into the engine's ``flags`` layer."""
import argparse
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from webui_attn.settings import flags, layers
from host_attn import voice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = os.path.join(ROOT, "preload.py")


def load_preload():
    spec = importlib.util.spec_from_file_location("preload.py", PRELOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parser_with_flags():
    parser = argparse.ArgumentParser()
    load_preload().preload(parser)
    return parser


def test_preload_imports_no_torch_and_defines_only_preload():
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('preload.py', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print('torch' in sys.modules, [n for n in vars(m) if callable(vars(m)[n]) and not n.startswith('_') "
            "and getattr(vars(m)[n], '__module__', '') == 'preload.py'])")
    out = subprocess.run([sys.executable, "-c", code, PRELOAD], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['preload']"


def test_defaults_leave_everything_unset():
    opts = parser_with_flags().parse_args([])
    assert (opts.opt_flash_attention, opts.opt_cudnn_attention, opts.opt_efficient_attention,
            opts.opt_sage_attention, opts.attn_strict) == (False,) * 5
    assert (opts.attn_backend, opts.attn_vae_backend, opts.attn_fp32) == (None, None, None)
    assert flags.layer_from(opts) is None


def test_every_flag_parses():
    opts = parser_with_flags().parse_args([
        "--opt-flash-attention", "--opt-cudnn-attention", "--opt-efficient-attention", "--opt-sage-attention",
        "--attn-backend", "flash-attn,sdpa", "--attn-vae-backend", "sdpa-efficient", "--attn-fp32", "keep",
        "--attn-strict"])
    assert opts.opt_flash_attention and opts.opt_cudnn_attention and opts.opt_efficient_attention
    assert opts.opt_sage_attention and opts.attn_strict
    assert (opts.attn_backend, opts.attn_vae_backend, opts.attn_fp32) == ("flash-attn,sdpa", "sdpa-efficient", "keep")


def test_attn_fp32_rejects_other_values():
    with pytest.raises(SystemExit):
        parser_with_flags().parse_args(["--attn-fp32", "half"])


def test_preload_twice_keeps_the_first_definition():
    parser = argparse.ArgumentParser()
    module = load_preload()
    module.preload(parser)
    module.preload(parser)
    assert parser.parse_args(["--opt-sage-attention"]).opt_sage_attention


def test_help_texts_say_what_runs_and_the_fallback():
    for flag, kwargs in load_preload().FLAGS:
        text = kwargs["help"]
        assert len(text) > 40, flag
        if flag != "--attn-fp32":
            assert "fall" in text or "Raise" in text, flag
        for example in re.findall(r"'([a-z0-9,-]+)'", text):
            for item in example.split(","):
                if "-" in item and item not in ("cast", "keep"):
                    assert item in lib_attn.BACKEND_IDS, (flag, item)


def test_opt_flags_build_the_denoiser_chain_in_a_fixed_order():
    opts = parser_with_flags().parse_args(["--opt-sage-attention", "--opt-flash-attention"])
    assert flags.layer_from(opts) == {"preference": {"unet": ["flash-attn", "sage"], "dit": ["flash-attn", "sage"]}}


def test_attn_backend_overrides_opt_flags_and_vae_has_its_own_chain():
    opts = parser_with_flags().parse_args(["--opt-flash-attention", "--attn-backend", "sdpa-math, math",
                                           "--attn-vae-backend", "sdpa", "--attn-fp32", "keep", "--attn-strict"])
    assert flags.layer_from(opts) == {
        "preference": {"unet": ["sdpa-math", "math"], "dit": ["sdpa-math", "math"], "vae": ["sdpa"]},
        "fp32": "keep", "strict": True}


def test_unknown_id_is_reported_with_valid_ids_and_ignored(capsys, monkeypatch):
    monkeypatch.setattr(voice, "_said", set())
    opts = parser_with_flags().parse_args(["--attn-backend", "flash-attn,flashy", "--attn-vae-backend", "sdpa"])
    try:
        layer = flags.apply(opts)
        out = capsys.readouterr().out
        assert "--attn-backend" in out and "flashy" in out
        assert all(i in out for i in lib_attn.BACKEND_IDS)
        assert layer == {"preference": {"vae": ["sdpa"]}}
        assert lib_attn.config().preference["unet"] is None
        assert lib_attn.config().preference["vae"] == ("sdpa",)
        assert flags.given_chain_flag(opts) == "attn_vae_backend"
    finally:
        layers.reset()


def test_flags_reach_the_engine_through_the_webui(webui_factory):
    webui_factory("a1111", argv=["--attn-backend", "sdpa-math", "--attn-fp32", "keep", "--attn-strict"])
    from modules import shared
    assert shared.cmd_opts.attn_backend == "sdpa-math"   # preload.py ran through the webui's extension scan
    flags.apply(shared.cmd_opts)
    config = lib_attn.config()
    assert config.preference["unet"] == ("sdpa-math",) and config.preference["dit"] == ("sdpa-math",)
    assert config.preference["vae"] is None
    assert (config.fp32, config.strict) == ("keep", True)


def test_fp32_for_upcast_defers_to_a_chosen_policy():
    try:
        assert flags.fp32_for_upcast(False) is None
        assert flags.fp32_for_upcast(True) == "keep"
        layers.set_layer("flags", {"fp32": "cast"})
        assert flags.fp32_for_upcast(True) is None
    finally:
        layers.reset()
