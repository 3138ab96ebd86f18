"""The installer's self-test of a kernel: the backend itself, strictly, against float64 — a kernel that raises
or computes the wrong attention fails it, naming the kernel and its error."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import Backend
from lib_attn.commands import selftest

SHAPES = ((1, 2, 128, 128, 40), (1, 2, 128, 77, 64))


class StandIn(Backend):
    devices = ("cpu",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self, bid, how):
        self.id, self.label, self.how = bid, bid, how

    def run(self, q, k, v, mask, scale):
        if self.how == "raises":
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
        # computed in fp32: torch 2.1's CPU SDPA has no fp16 kernel
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, scale=scale)
        return (out * 1.5 if self.how == "off" else out).to(q.dtype)


@pytest.fixture
def stand_in():
    made = []

    def register(how, bid=None):
        backend = StandIn(bid or f"test-kernel-{how}", how)
        lib_attn.register_backend(backend)
        made.append(backend.id)
        return backend.id
    lib_attn.reset()
    yield register
    for bid in made:
        lib_attn.unregister_backend(bid)
    lib_attn.reset()


def test_a_good_kernel_passes_with_its_error_against_float64(stand_in):
    result = selftest.run(stand_in("good"), "cpu", torch.float32, SHAPES)
    assert result.passed and len(result.calls) == 2
    assert all(err < 1e-5 for _, err in result.calls)
    assert "ran 2 test calls on cpu" in result.text and "against float64" in result.text


def test_a_kernel_that_raises_fails_with_its_own_error_never_another_kernels_result(stand_in):
    bid = stand_in("raises")
    result = selftest.run(bid, "cpu", torch.float32, SHAPES)
    assert not result.passed and not result.calls
    assert result.text.startswith(f"{bid} raised on a 1x2x128x128x40 call on cpu: RuntimeError: CUDA error: "
                                  "no kernel image is available")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_kernel_50_percent_off_fails_in_every_dtype(stand_in, dtype):
    bid = stand_in("off")
    result = selftest.run(bid, "cpu", dtype, SHAPES)
    assert not result.passed
    assert f"{bid} is wrong on a 1x2x128x128x40 call on cpu: relative error 5.0e-01" in result.text


def test_a_kernel_the_engine_gives_no_call_fails_saying_why(stand_in):
    result = selftest.run("flash-attn", "cpu", torch.float16, SHAPES)
    if lib_attn.explain(*(torch.zeros(1, 2, 128, 40, dtype=torch.float16),) * 3, backend="flash-attn").backend == "flash-attn":
        pytest.skip("flash-attn takes CPU calls here")
    assert not result.passed and result.text.startswith("the engine gives flash-attn none of the test calls on cpu (")


def test_main_prints_one_line_and_exits_4_on_failure(stand_in, capsys):
    assert selftest.main([stand_in("off"), "cpu"]) == 4
    assert "is wrong" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert selftest.main(["sdpa"]) == 0 and capsys.readouterr().out == "skipped: no CUDA device\n"
