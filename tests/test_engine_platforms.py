"""AMD (ROCm) and Apple (MPS) devices, described as torch reports them: chains, reasons in each
platform's own terms, the size rule, and the cast dtype. No kernel runs."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

import lib_attn
from lib_attn import _compat, device as device_mod
from lib_attn import kernels as registry
from lib_attn.device import DeviceInfo
from lib_attn.chains import FULL_MATRIX_MAX_BYTES, default_chain, score_bytes
from lib_attn.decision import decide
from lib_attn.kernels import Status
from lib_attn.spec import CallSpec

from engine_helpers import install_sage, sage_release

# What a ROCm build of torch reports: device type "cuda", a capability that is not an NVIDIA one.
MI300 = DeviceInfo("cuda", 0, "AMD Instinct MI300X", (9, 4), 192 * 2**30, platform="rocm", arch="gfx942",
                   hip="6.2.41133", miopen=3002000)
MI200 = DeviceInfo("cuda", 0, "AMD Instinct MI250X/MI250", (9, 0), 64 * 2**30, platform="rocm", arch="gfx90a",
                   hip="6.2.41133", miopen=3002000)
RDNA3 = DeviceInfo("cuda", 0, "AMD Radeon RX 7900 XTX", (11, 0), 24 * 2**30, platform="rocm", arch="gfx1100",
                   hip="6.2.41133", miopen=3002000)
GFX906 = DeviceInfo("cuda", 0, "AMD Radeon VII", (9, 0), 16 * 2**30, platform="rocm", arch="gfx906",
                    hip="6.2.41133", miopen=3002000)
MAC = DeviceInfo("mps", None, "Apple GPU", macos=(14, 5))
OLD_MAC = DeviceInfo("mps", None, "Apple GPU", macos=(13, 6))
ROCM_DEVICES = (MI300, MI200, RDNA3, GFX906)

ALL_INSTALLED = {bid: Status(True, version="test") for bid in lib_attn.BACKEND_IDS}
FUSED = ("flash-attn", "sdpa-flash", "sdpa-efficient")


def spec(device, dtype=torch.float16, b=2, h=8, q=4096, kv=77, d=64, mask="none", mask_dtype=None, role="unet"):
    return CallSpec(device, dtype, b, h, q, kv, d, mask=mask, mask_dtype=mask_dtype, role=role)


SD15_CROSS = dict(b=2, h=8, q=4096, kv=77, d=40)
SDXL_SELF_1024 = dict(b=2, h=10, q=4096, kv=4096, d=64)   # 640 MiB of fp16 scores
VAE_1024 = dict(b=1, h=1, q=16384, kv=16384, d=512, role="vae")
VAE_512 = dict(b=1, h=1, q=4096, kv=4096, d=512, role="vae")


@pytest.fixture(autouse=True)
def installed_packages(monkeypatch):
    """flash-attn 2 (CK build unless a test says otherwise), xformers and sage installed; torch 2.13."""
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(fa, "fa2", object())
    monkeypatch.setattr(fa, "fa3", None)
    monkeypatch.setattr(fa, "rocm_build", "CK")
    install_sage(monkeypatch, sage_release("2.2.0"))
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 13))
    monkeypatch.setattr(_compat, "TORCH_VERSION_TEXT", "2.13.0+rocm7.1")
    monkeypatch.setattr(_compat, "flash_built", lambda: True)
    monkeypatch.delenv(_compat.AOTRITON_SWITCH, raising=False)
    lib_attn.reset()
    yield
    lib_attn.reset()


def chain(device, **call):
    return default_chain(call.get("role", "unet"), device, spec=spec(device, **call))


def all_reasons(call):
    return [r for bid in lib_attn.BACKEND_IDS for r in registry.REGISTRY[bid].reasons(call)]


# --- chains ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [MI300, MI200])
def test_mi200_and_mi300_chain_is_flash_attn_then_aotriton_then_sdpa(device):
    assert default_chain("unet", device, cudnn=91600) == FUSED + ("sdpa", "math")
    d = decide(spec(device), chain(device, **SD15_CROSS), ALL_INSTALLED)
    assert d.backend == "flash-attn" and d.variant == "CK" and not d.rejected
    # A large call never reaches PyTorch's full-matrix fallback: the bounded path follows the fused kernels.
    assert chain(device, **SDXL_SELF_1024) == FUSED + ("math",)


def test_mi300_is_not_taken_for_hopper():
    """torch reports MI300X as capability (9, 4): the Hopper chain (cuDNN first) must not apply."""
    for role in lib_attn.ROLES:
        assert "sdpa-cudnn" not in default_chain(role, MI300, fa3=False, cudnn=91600)
    assert any("does not exist on ROCm" in r for r in registry.REGISTRY["sdpa-cudnn"].reasons(spec(MI300)))


def test_rdna3_runs_aotriton_and_flash_attn_only_with_its_triton_build(monkeypatch):
    d = decide(spec(RDNA3, **SD15_CROSS), chain(RDNA3, **SD15_CROSS), ALL_INSTALLED)
    assert d.backend == "sdpa-flash"
    assert d.reasons_for("flash-attn") == [
        "gfx1100: no flash-attn kernel for this GPU (the CK build covers MI200/MI300/MI350 (gfx90a, gfx942, "
        "gfx950); the Triton build (FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE) also covers RDNA3/4)"]
    monkeypatch.setattr(registry.REGISTRY["flash-attn"], "rocm_build", "Triton")
    d = decide(spec(RDNA3, **SD15_CROSS), chain(RDNA3, **SD15_CROSS), ALL_INSTALLED)
    assert d.backend == "flash-attn" and d.variant == "Triton"


def test_rdna3_behind_the_experimental_switch_names_it_and_keeps_large_calls_bounded(monkeypatch):
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 6))
    monkeypatch.setattr(_compat, "TORCH_VERSION_TEXT", "2.6.0+rocm6.2.4")
    statuses = dict(ALL_INSTALLED, **{"flash-attn": Status(False, "ModuleNotFoundError: No module named 'flash_attn'")})
    small = decide(spec(RDNA3, **SD15_CROSS), chain(RDNA3, **SD15_CROSS), statuses)
    assert small.backend == "sdpa"
    expected = ("gfx1100: torch 2.6.0+rocm6.2.4 keeps its AOTriton attention kernels off on this GPU "
                "(experimental) unless TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 is set")
    assert small.reasons_for("sdpa-flash") == [expected]
    assert small.reasons_for("sdpa-efficient") == [expected]
    large = decide(spec(RDNA3, **SDXL_SELF_1024), chain(RDNA3, **SDXL_SELF_1024), statuses)
    assert large.backend == "math"
    monkeypatch.setenv(_compat.AOTRITON_SWITCH, "1")
    assert decide(spec(RDNA3, **SDXL_SELF_1024), chain(RDNA3, **SDXL_SELF_1024), statuses).backend == "sdpa-flash"


def test_gfx906_has_no_fused_kernel_so_large_calls_take_the_bounded_path(monkeypatch):
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(type(fa), "trial", lambda self, index, dtype: "RuntimeError: HIP error: invalid device function")
    assert chain(GFX906, **SD15_CROSS) == ("sdpa", "math")
    assert decide(spec(GFX906, **SD15_CROSS), chain(GFX906, **SD15_CROSS), ALL_INSTALLED).backend == "sdpa"
    for call in (SDXL_SELF_1024, VAE_1024):
        assert chain(GFX906, **call) == ("math",)
        assert decide(spec(GFX906, **call), chain(GFX906, **call), ALL_INSTALLED).backend == "math"
    # Asked by name, every fused kernel says why, in the GPU's own terms.
    explicit = ("flash-attn", "sdpa-flash", "sdpa-efficient", "xformers", "sage", "sdpa-cudnn", "math")
    d = decide(spec(GFX906, **SD15_CROSS), explicit, ALL_INSTALLED, explicit=True)
    assert d.backend == "math"
    for bid, reasons in d.rejected:
        assert reasons and all("gfx906" in r or "ROCm" in r for r in reasons), (bid, reasons)
    assert d.reasons_for("flash-attn") == [
        "gfx906: no flash-attn kernel for this GPU, and a trial call failed: RuntimeError: HIP error: invalid device function"]
    assert d.reasons_for("sdpa-flash") == [
        "gfx906: no fused attention kernel in this torch build (AOTriton has none for it)"]


def test_flash_attn_asked_by_name_on_an_undocumented_amd_gpu_gets_a_trial_call(monkeypatch):
    fa = registry.REGISTRY["flash-attn"]
    calls = []
    monkeypatch.setattr(type(fa), "trial", lambda self, index, dtype: calls.append(dtype) or "")
    assert fa.reasons(spec(GFX906)) and calls == []
    assert fa.reasons(spec(GFX906), asked=True) == [] and calls == [torch.float16]


@pytest.mark.parametrize("device", ROCM_DEVICES + (MAC,))
def test_reasons_never_speak_of_nvidia_architectures(device):
    calls = [spec(device, **SD15_CROSS), spec(device, dtype=torch.bfloat16, **SDXL_SELF_1024),
             spec(device, **VAE_1024), spec(device, mask="dense", mask_dtype=torch.bool)]
    for call in calls:
        for reason in all_reasons(call):
            assert not re.search(r"\bsm\d", reason), reason


def test_aotriton_head_dim_limit_follows_torch(monkeypatch):
    vae = spec(MI300, **VAE_512)
    assert decide(vae, default_chain("vae", MI300, spec=vae), ALL_INSTALLED).backend == "sdpa-flash"
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 6))
    assert "head_dim 512 > 256 (AOTriton in torch 2.13.0+rocm7.1)" in registry.REGISTRY["sdpa-flash"].reasons(vae)
    assert decide(vae, default_chain("vae", MI300, spec=vae), ALL_INSTALLED).backend == "sdpa"
    big = spec(MI300, **VAE_1024)
    assert decide(big, default_chain("vae", MI300, spec=big), ALL_INSTALLED).backend == "math"


def test_xformers_and_sage_on_rocm():
    assert registry.REGISTRY["xformers"].reasons(spec(MI300)) == []
    assert registry.REGISTRY["xformers"].reasons(spec(RDNA3)) == [
        "gfx1100: xformers' ROCm build has attention kernels for MI200/MI300 (gfx90a, gfx942) only"]
    assert any("no ROCm build" in r for r in registry.REGISTRY["sage"].reasons(spec(MI300)))


def test_efficient_kernel_alignment_on_rocm():
    eff = registry.REGISTRY["sdpa-efficient"]
    assert "head_dim 20 not a multiple of 8" in eff.reasons(spec(MI300, d=20))
    assert "head_dim 18 not a multiple of 4" in eff.reasons(spec(MI300, d=18, dtype=torch.float32))
    assert eff.reasons(spec(MI300, d=20, dtype=torch.float32)) == []


# --- MPS ---------------------------------------------------------------------------------------

def test_mps_chain_is_pytorchs_sdpa_below_the_size_and_the_bounded_path_above():
    assert default_chain("unet", MAC) == ("sdpa", "math")
    assert chain(MAC, **SD15_CROSS) == ("sdpa", "math")
    assert chain(MAC, **VAE_512) == ("sdpa", "math")
    for call in (VAE_1024, SDXL_SELF_1024):
        assert chain(MAC, **call) == ("math",)
        assert chain(MAC, dtype=torch.float32, **call) == ("math",)
    d = decide(spec(MAC, **SD15_CROSS), ("flash-attn",) + chain(MAC, **SD15_CROSS), ALL_INSTALLED, explicit=True)
    assert d.backend == "sdpa" and d.reasons_for("flash-attn") == ["device mps not supported (cuda only)"]


def test_size_rule_threshold_is_the_score_matrix_in_the_calls_dtype():
    at = spec(MAC, b=1, h=1, q=8192, kv=8192)          # 8192² fp16 = 128 MiB
    assert score_bytes(at) == 128 * 2**20 and chain(MAC, b=1, h=1, q=8192, kv=8192) == ("sdpa", "math")
    over = dict(b=1, h=1, q=8192, kv=8192 * 2 + 8)     # just over 256 MiB in fp16
    assert score_bytes(spec(MAC, **over)) > FULL_MATRIX_MAX_BYTES and chain(MAC, **over) == ("math",)
    # The same call in fp32 is twice the bytes.
    assert chain(MAC, dtype=torch.float32, b=1, h=1, q=8192, kv=8192 + 8) == ("math",)


def test_mps_cast_dtype_follows_macos():
    assert MAC.half_dtype == torch.bfloat16
    assert OLD_MAC.half_dtype == torch.float16
    assert RDNA3.half_dtype == torch.bfloat16 and GFX906.half_dtype == torch.float16


def test_nvidia_and_cpu_chains_ignore_the_calls_size():
    ampere = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))
    for device in (ampere, DeviceInfo("cpu")):
        for call in (SD15_CROSS, SDXL_SELF_1024, VAE_1024):
            role = call.get("role", "unet")
            assert default_chain(role, device, spec=spec(device, **call)) == default_chain(role, device)


# --- the device model --------------------------------------------------------------------------

def test_rocm_device_is_read_with_arch_hip_and_miopen(monkeypatch):
    props = SimpleNamespace(name="AMD Instinct MI250X/MI250", major=9, minor=0, total_memory=64 * 2**30,
                            gcnArchName="gfx90a:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 3002000)
    device_mod._info.cache_clear()
    try:
        info = device_mod._info("cuda", None)
    finally:
        device_mod._info.cache_clear()
    assert (info.type, info.platform, info.arch, info.hip, info.miopen) == ("cuda", "rocm", "gfx90a", "6.2.41133-dd7f95766", 3002000)
    assert info.capability == (9, 0) and info.sm is None
    assert info.describe() == "AMD Instinct MI250X/MI250 (gfx90a, ROCm)"
    assert device_mod.miopen_text(info.miopen) == "3.2.0"
    fields = dataclasses.asdict(info)
    assert {"type", "index", "name", "capability", "total_memory", "platform", "arch", "hip", "miopen", "macos"} <= set(fields)


def test_existing_descriptions_keep_their_meaning():
    nvidia = DeviceInfo("cuda", 0, "H200", (9, 0))
    assert nvidia.platform == "cuda" and nvidia.sm == 90 and nvidia.describe() == "H200 (sm90)"
    assert DeviceInfo("cpu").platform == "cpu" and DeviceInfo("mps").platform == "mps"


# --- the doctor report of a described device ----------------------------------------------------

@pytest.fixture
def every_package(monkeypatch):
    """Probes as on a machine where every package is installed (the backends table says "yes")."""
    monkeypatch.setattr(registry, "_status", {bid: Status(True, version="test") for bid in lib_attn.BACKEND_IDS})


def described(info):
    from lib_attn.commands import doctor

    doc = doctor.report(info=info)
    return doc, doctor.render(doc)


def picks(doc, model, where):
    return next(d for d in doc["decisions"] if d["model"] == model and d["where"] == where)


@pytest.mark.parametrize("device,unet,vae", [
    (MI300, "flash-attn", "sdpa-flash"), (MI200, "flash-attn", "sdpa-flash"),
    (RDNA3, "sdpa-flash", "sdpa-flash"), (GFX906, "math", "math"), (MAC, "math", "math"),
])
def test_doctor_report_of_a_described_device(every_package, device, unet, vae):
    doc, text = described(device)
    assert doc["described"] and doc["device"]["platform"] == device.platform
    assert not re.search(r"\bsm\d", text)
    # SDXL's largest self-attention (640 MiB of fp16 scores) and the VAE's 16384² call at 1024².
    assert picks(doc, "sdxl", "self L1")["backend"] == unet
    assert picks(doc, "vae", "mid")["backend"] == vae
    lines = text.splitlines()
    if device.platform == "rocm":
        assert f"({device.arch}, ROCm: HIP 6.2.41133, MIOpen 3.2.0," in text
        assert "  ROCm      HIP 6.2.41133" in lines and "  MIOpen    3.2.0" in lines
        assert not any(line.startswith(("  CUDA", "  cuDNN")) for line in lines)
        assert doc["versions"]["cudnn"] is None and doc["versions"]["miopen"] == 3002000
        assert f"decisions with the current configuration on {device.arch} " in text
    else:
        assert "  device    Apple GPU (MPS)" in lines and "  MPS       macOS 14.5" in lines
        assert not any(line.startswith(("  CUDA", "  cuDNN")) for line in lines)
    cross = picks(doc, "sdxl", "cross L1")
    assert cross["backend"] == {"flash-attn": "flash-attn", "sdpa-flash": "sdpa-flash"}.get(unet, "sdpa")


def test_doctor_gives_each_passed_over_kernel_its_amd_reason(every_package):
    doc, text = described(RDNA3)
    unet = picks(doc, "sdxl", "self L1")
    assert [bid for bid, _ in unet["rejected"]] == ["flash-attn"]
    assert unet["rejected"][0][1][0].startswith("gfx1100: no flash-attn kernel for this GPU")
    assert "        flash-attn: gfx1100: no flash-attn kernel for this GPU (the CK build covers" in "\n".join(text.splitlines())
    # gfx906 has no fused kernel at all: nothing is passed over, PyTorch's sdpa or the bounded path run.
    doc, _ = described(GFX906)
    assert all(not d["rejected"] for d in doc["decisions"])


def test_availability_table_names_the_amd_gpu_in_its_own_terms():
    from webui_attn.ui import components
    from webui_attn.ui.api import availability

    data = availability(MI300)
    assert data["device"]["platform"] == "rocm" and data["device"]["arch"] == "gfx942"
    assert data["device"]["hip"] == "6.2.41133" and data["device"]["miopen"] == 3002000
    text = components.availability_html(data)
    assert "Device: AMD Instinct MI300X (gfx942, ROCm: HIP 6.2.41133, MIOpen 3.2.0), 192.0 GiB" in text
    assert "compute capability" not in text
    assert "UNet: flash-attn → sdpa-flash → sdpa-efficient → sdpa → math" in text
    nvidia = components.availability_html(availability(DeviceInfo("cuda", 0, "RTX 3090", (8, 6), 24 * 2**30)))
    assert "RTX 3090 (compute capability 8.6), 24.0 GiB" in nvidia


def test_a_rocm_build_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = registry.REGISTRY["sdpa-efficient"].probe()
    assert not found.available and found.reason == "no CUDA device (torch built for ROCm (HIP 6.2.41133))"
    assert registry.REGISTRY["sdpa-cudnn"].probe().reason.startswith("cuDNN attention does not exist on ROCm")


@pytest.mark.parametrize("triton,build", [(True, "Triton"), (False, "CK")])
def test_flash_attn_probe_tells_its_rocm_builds_apart(monkeypatch, triton, build):
    import sys
    import types

    from lib_attn.kernels.flash import FlashAttn

    package = types.ModuleType("flash_attn")
    package.flash_attn_func = package.flash_attn_varlen_func = lambda *a, **k: None
    package.__version__ = "2.8.3"
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.USE_TRITON_ROCM = triton
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no FA3
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    fa = FlashAttn()
    fa.probe()
    assert fa.rocm_build == build
    assert fa.variant(spec(MI300)) == build
