"""A1111's "Automatic" on an AMD GPU and on a Mac: the auto entry outranks A1111's own choice only
where the engine has a fused kernel for the device."""
import pytest
import torch

import lib_attn
from lib_attn import _compat
from tests.doubles.fixtures import webui_factory  # noqa: F401
from tests.test_a1111 import TITLES, selected, simulate_backends, start
from tests.test_engine_platforms import GFX906, MI300, RDNA3

ROCM_PACKAGES = {"sdpa-flash", "sdpa-efficient", "sdpa", "sdpa-math", "math"}


@pytest.fixture
def rocm(monkeypatch):
    """A ROCm build of torch on a described AMD GPU (nothing touches a GPU)."""
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 13))
    monkeypatch.setattr(_compat, "flash_built", lambda: True)
    monkeypatch.delenv(_compat.AOTRITON_SWITCH, raising=False)

    def on(info):
        monkeypatch.setattr(lib_attn, "device_info", lambda device=None: info)
    return on


@pytest.mark.parametrize("info", [MI300, RDNA3])
def test_amd_gpu_with_aotriton_kernels_automatic_picks_auto(webui_factory, monkeypatch, rocm, info):
    rocm(info)
    simulate_backends(monkeypatch, ROCM_PACKAGES)
    start(webui_factory, device="cuda")
    assert selected().title() == TITLES["auto"]


def test_amd_gpu_without_a_fused_kernel_keeps_doggettx(webui_factory, monkeypatch, rocm):
    rocm(GFX906)
    simulate_backends(monkeypatch, ROCM_PACKAGES)
    start(webui_factory, device="cuda")
    assert selected().name == "Doggettx"


def test_amd_gpu_behind_the_experimental_switch_keeps_doggettx_until_it_is_set(webui_factory, monkeypatch, rocm):
    rocm(RDNA3)
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 6))
    simulate_backends(monkeypatch, ROCM_PACKAGES)
    start(webui_factory, device="cuda")
    assert selected().name == "Doggettx"


def test_mac_keeps_sub_quadratic_even_with_every_package(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, set(lib_attn.BACKEND_IDS))
    start(webui_factory, device="mps")
    assert selected().name == "sub-quadratic"


def test_mac_flag_still_puts_the_engine_first(webui_factory, monkeypatch):
    simulate_backends(monkeypatch, set(lib_attn.BACKEND_IDS))
    start(webui_factory, ["--attn-backend=sdpa"], device="mps")
    assert selected().title() == TITLES["auto"]
