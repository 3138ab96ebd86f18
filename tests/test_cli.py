"""``python -m lib_attn``: the three commands read their shared options the same way and say the same
thing about the same mistake."""
from __future__ import annotations

import pytest
import torch

from lib_attn.__main__ import build_parser, main


def usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
def test_a_cuda_device_without_cuda_is_one_usage_error_for_bench_and_tune(capsys):
    messages = {usage_error([command, "--device", device], capsys)
                for command in ("bench", "tune") for device in ("cuda", "cuda:1")}
    assert messages == {"python -m lib_attn: error: --device cuda: this torch sees no CUDA device"}


def test_an_unknown_dtype_is_one_usage_error_for_all_three_commands(capsys):
    messages = {usage_error(argv, capsys) for argv in (["doctor", "--dtype", "fp8"],
                                                       ["bench", "--dtype", "fp16", "fp8"],
                                                       ["tune", "--dtype", "fp16,fp8"])}
    assert len(messages) == 1
    (message,) = messages
    assert "dtype must be one of bf16, bfloat16, float, float16, float32, fp16, fp32, half; got 'fp8'" in message


def test_a_resolution_no_model_takes_is_one_usage_error_for_bench_and_tune(capsys):
    messages = {usage_error([command, "--model", "sd15", "--res", "500", "--device", "cpu"], capsys)
                for command in ("bench", "tune")}
    assert len(messages) == 1 and "res must be a positive multiple of 8" in messages.pop()


def test_bench_and_tune_offer_the_same_workload_and_device_options():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices

    def options(command):
        return {a.dest: a for a in sub[command]._actions if a.dest in ("model", "res", "dtype", "device")}

    bench, tune = options("bench"), options("tune")
    assert set(bench) == set(tune) == {"model", "res", "dtype", "device"}
    for dest in ("res", "dtype", "device"):
        assert (bench[dest].help, bench[dest].nargs, bench[dest].choices) == \
            (tune[dest].help, tune[dest].nargs, tune[dest].choices)
    assert bench["model"].choices == tune["model"].choices
    assert "all" in bench["model"].choices and "sd15" in bench["model"].choices
    assert "calls to time" in bench["model"].help and "calls to tune" in tune["model"].help


@pytest.mark.parametrize("command", ["doctor", "bench", "tune", "parallel"])
def test_every_command_prints_its_help(command, capsys):
    # argparse formats each help text with %: a literal one (the default schedule's "0-20%") must be doubled.
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert f"python -m lib_attn {command}" in capsys.readouterr().out
