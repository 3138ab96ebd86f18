"""Decisions for GPU-only backends, from a described call and device: no kernel runs."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import kernels as registry
from lib_attn.kernels import Status
from lib_attn.device import DeviceInfo
from lib_attn.chains import default_chain
from lib_attn.decision import decide
from lib_attn.spec import CallSpec

from engine_helpers import install_sage, sage_release

AMPERE = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))
HOPPER = DeviceInfo("cuda", 0, "H200", (9, 0))
TURING = DeviceInfo("cuda", 0, "RTX 2080", (7, 5))

ALL_INSTALLED = {bid: Status(True, version="test") for bid in lib_attn.BACKEND_IDS}


def spec(device=AMPERE, dtype=torch.float16, d=64, q=4096, kv=77, mask="none", mask_dtype=None, role="unet", grad=False):
    return CallSpec(device, dtype, 2, 8, q, kv, d, mask=mask, mask_dtype=mask_dtype, role=role, requires_grad=grad)


@pytest.fixture(autouse=True)
def installed_packages(monkeypatch):
    """The package probes as a machine with FA2 (no FA3), xformers 2 and sage 2 would see them."""
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(fa, "fa2", object())
    monkeypatch.setattr(fa, "fa3", None)
    install_sage(monkeypatch, sage_release("2.2.0"))
    # A CUDA build of torch, whatever build runs the tests.
    monkeypatch.setattr("lib_attn._compat.flash_built", lambda: True)
    lib_attn.reset()
    yield
    lib_attn.reset()


def reasons(backend_id, call):
    return registry.REGISTRY[backend_id].reasons(call)


def test_flash_attn_reasons():
    fa = "flash-attn"
    assert reasons(fa, spec()) == []
    assert "head_dim 512 > 256" in reasons(fa, spec(d=512))
    assert "dtype float32 not supported (fp16/bf16)" in reasons(fa, spec(dtype=torch.float32))
    assert "GPU sm75 < sm80" in reasons(fa, spec(device=TURING))
    assert "dense attention mask not supported" in reasons(fa, spec(mask="dense", mask_dtype=torch.bool))
    assert reasons(fa, spec(mask="key-padding", mask_dtype=torch.bool)) == []  # varlen path
    assert any("float attention mask" in r for r in reasons(fa, spec(mask="key-padding", mask_dtype=torch.float16)))
    assert "device cpu not supported (cuda only)" in reasons(fa, spec(device=DeviceInfo("cpu")))


def test_sage_reasons():
    assert reasons("sage", spec()) == []
    assert "head_dim 160 > 128" in reasons("sage", spec(d=160))
    assert "key-padding attention mask not supported" in reasons("sage", spec(mask="key-padding", mask_dtype=torch.bool))
    assert "no backward pass (inference only)" in reasons("sage", spec(grad=True))
    assert any("sm75" in r for r in reasons("sage", spec(device=TURING)))


def test_sage_1x_runs_from_volta_in_fp16(monkeypatch):
    install_sage(monkeypatch, sage_release("1.0.6"))
    assert reasons("sage", spec(device=TURING, kv=4096)) == []
    assert "bf16 needs sm80, GPU is sm75" in reasons("sage", spec(device=TURING, dtype=torch.bfloat16, kv=4096))
    assert "GPU sm61 < sm70" in reasons("sage", spec(device=DeviceInfo("cuda", 0, "P40", (6, 1)), kv=4096))


def test_sdpa_kernel_reasons():
    assert "head_dim 512 > 256" in reasons("sdpa-flash", spec(d=512))
    assert "dense attention mask not supported" in reasons("sdpa-flash", spec(mask="dense", mask_dtype=torch.bool))
    assert "GPU sm75 < sm80" in reasons("sdpa-cudnn", spec(device=TURING))
    assert "head_dim 160 > 128" in reasons("sdpa-cudnn", spec(d=160))
    assert reasons("sdpa-efficient", spec(d=512, dtype=torch.float32)) == []
    assert "bf16 needs sm80, GPU is sm75" in reasons("sdpa-efficient", spec(device=TURING, dtype=torch.bfloat16))


def test_cpu_flash_names_the_mask_when_torch_takes_none(monkeypatch):
    from lib_attn import _compat
    cpu = dict(device=DeviceInfo("cpu"), dtype=torch.float32, q=64)
    masked = spec(mask="key-padding", mask_dtype=torch.bool, **cpu)
    monkeypatch.setattr(_compat, "CPU_FLASH_TAKES_MASK", False)  # torch before 2.3
    found = reasons("sdpa-flash", masked)
    assert found == [f"key-padding attention mask: torch {_compat.TORCH_VERSION_TEXT}'s CPU flash kernel takes no mask"]
    assert reasons("sdpa-flash", spec(**cpu)) == []
    monkeypatch.setattr(_compat, "CPU_FLASH_TAKES_MASK", True)
    assert reasons("sdpa-flash", masked) == []


def test_cudnn_switched_off_reason(monkeypatch):
    from lib_attn import _compat
    monkeypatch.setattr(_compat, "TORCH_VERSION", (2, 4))
    monkeypatch.delenv("TORCH_CUDNN_SDPA_ENABLED", raising=False)
    assert any("TORCH_CUDNN_SDPA_ENABLED=1" in r for r in reasons("sdpa-cudnn", spec()))
    monkeypatch.setenv("TORCH_CUDNN_SDPA_ENABLED", "1")
    assert not any("TORCH_CUDNN" in r for r in reasons("sdpa-cudnn", spec()))


def test_default_chains_pick_the_fused_kernels():
    assert decide(spec(), default_chain("unet", AMPERE), ALL_INSTALLED).backend == "flash-attn"
    # Hopper with a recent cuDNN: cuDNN leads without FA3; with FA3, flash-attn does. With an older
    # cuDNN, or on consumer Blackwell (sm120), the Ampere order holds.
    assert default_chain("unet", HOPPER, fa3=False, cudnn=91501)[0] == "sdpa-cudnn"
    assert default_chain("unet", HOPPER, fa3=True, cudnn=91501)[0] == "flash-attn"
    assert default_chain("unet", HOPPER, fa3=False, cudnn=90100) == default_chain("unet", AMPERE)
    assert default_chain("unet", DeviceInfo("cuda", 0, "RTX 5090", (12, 0)), cudnn=91600) == default_chain("unet", AMPERE)
    vae = decide(spec(d=512, q=4096, kv=4096, role="vae"), default_chain("vae", AMPERE), ALL_INSTALLED)
    assert vae.backend == "sdpa-efficient"
    assert default_chain("unet", DeviceInfo("cpu"))[0] == "sdpa"
    for role in lib_attn.ROLES:
        for device in (AMPERE, HOPPER, TURING, DeviceInfo("cpu")):
            chain = default_chain(role, device, fa3=False, cudnn=91600)
            assert chain[-1] == "math" and "sage" not in chain


def test_sd15_head_dim_160_under_sage_falls_back_with_reason():
    chain = ("sage",) + default_chain("unet", AMPERE)
    d = decide(spec(d=160, q=256, kv=256), chain, ALL_INSTALLED, explicit=True)
    assert d.backend == "flash-attn"
    assert d.preferred == "sage" and d.fallback
    assert d.reasons_for("sage") == ["head_dim 160 > 128"]
    assert d.fallback_key == ("unet", "sage", "head_dim 160 > 128")


def test_fp32_cast_and_keep():
    chain = default_chain("unet", AMPERE)
    cast = decide(spec(dtype=torch.float32), chain, ALL_INSTALLED, fp32="cast")
    assert cast.backend == "flash-attn" and cast.cast == torch.bfloat16
    older = decide(spec(device=TURING, dtype=torch.float32), ("sdpa-flash", "sdpa-efficient", "math"), ALL_INSTALLED, fp32="cast")
    assert older.backend == "sdpa-efficient" and older.cast is None  # efficient takes fp32 itself
    keep = decide(spec(dtype=torch.float32), chain, ALL_INSTALLED, fp32="keep")
    assert keep.backend == "xformers" and keep.cast is None
    assert keep.reasons_for("flash-attn") == ["dtype float32 not supported (fp16/bf16) (fp32 policy: keep)"]


def test_cast_goes_to_fp16_on_gpus_without_bf16():
    d = decide(spec(device=TURING, dtype=torch.float32), ("sage", "math"), ALL_INSTALLED, fp32="cast")
    assert d.backend == "math"  # sage 2 has no Turing kernel
    assert DeviceInfo("cuda", 0, "T4", (7, 5)).half_dtype == torch.float16


def test_unavailable_backend_keeps_its_probe_text():
    statuses = dict(ALL_INSTALLED, **{"flash-attn": Status(False, "ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c10")})
    d = decide(spec(), default_chain("unet", AMPERE), statuses, explicit=True)
    assert d.backend == "sdpa-flash"
    assert "undefined symbol" in d.reasons_for("flash-attn")[0]
    assert d.fallback  # the user asked for flash-attn by name
    auto = decide(spec(), default_chain("unet", AMPERE), statuses)
    assert auto.backend == "sdpa-flash" and not auto.fallback  # auto: nothing was asked of flash-attn


def test_run_time_failure_demotes_for_the_signature():
    d = decide(spec(), default_chain("unet", AMPERE), ALL_INSTALLED, failed={"flash-attn": "RuntimeError: no kernel image"})
    assert d.backend == "sdpa-flash"
    assert d.reasons_for("flash-attn") == ["failed at run time: RuntimeError: no kernel image"]
    assert d.fallback_key[1] == "flash-attn"


def test_older_gpu_trial_only_when_asked(monkeypatch):
    fa = registry.REGISTRY["flash-attn"]
    calls = []
    monkeypatch.setattr(type(fa), "trial", lambda self, index, dtype: calls.append(dtype) or "")
    assert "GPU sm75 < sm80" in fa.reasons(spec(device=TURING))
    assert calls == []
    assert fa.reasons(spec(device=TURING), asked=True) == []  # the community build took the trial call
    monkeypatch.setattr(type(fa), "trial", lambda self, index, dtype: "RuntimeError: FlashAttention only supports Ampere GPUs or newer.")
    assert fa.reasons(spec(device=TURING), asked=True) == [
        "GPU sm75 < sm80, and a trial call failed: RuntimeError: FlashAttention only supports Ampere GPUs or newer."]


def test_fa3_variant_on_hopper(monkeypatch):
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(fa, "fa3", object())
    assert fa.variant(spec(device=HOPPER)) == "FA3"
    assert fa.variant(spec(device=AMPERE)) == "FA2"
    assert fa.variant(spec(device=HOPPER, mask="key-padding", mask_dtype=torch.bool)) == "FA2"


def test_hot_path_does_not_probe_or_decide_again(monkeypatch):
    q = k = v = torch.randn(1, 2, 8, 16)
    lib_attn.attention(q, k, v)

    def forbidden(*args, **kwargs):
        raise AssertionError("hot path must not probe or decide")
    monkeypatch.setattr(registry, "status", forbidden)
    monkeypatch.setattr("lib_attn.dispatch.decide", forbidden)
    for _ in range(3):
        lib_attn.attention(q, k, v)


def test_sage_architectures_and_version_1_head_sizes(monkeypatch):
    sm89 = DeviceInfo("cuda", 0, "RTX 4090", (8, 9))
    assert reasons("sage", spec(device=sm89)) == []
    assert any("sm87" in r for r in reasons("sage", spec(device=DeviceInfo("cuda", 0, "Orin", (8, 7)))))
    assert any("sm100" in r for r in reasons("sage", spec(device=DeviceInfo("cuda", 0, "B200", (10, 0)))))
    install_sage(monkeypatch, sage_release("1.0.6"))
    assert reasons("sage", spec(device=sm89, d=64, kv=4096)) == []
    assert "head_dim 40 not in 64/96/128 (SageAttention 1.0.6)" in reasons("sage", spec(device=sm89, d=40, kv=4096))


def test_efficient_kernel_head_dim_alignment():
    assert "head_dim 20 not a multiple of 8" in reasons("sdpa-efficient", spec(d=20))
    assert reasons("sdpa-efficient", spec(d=20, dtype=torch.float32)) == []
    assert "head_dim 18 not a multiple of 4" in reasons("sdpa-efficient", spec(d=18, dtype=torch.float32))


def test_cudnn_head_dim_limits_by_architecture(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_ENABLED", "1")  # torch before 2.5 needs it (tested above)
    assert reasons("sdpa-cudnn", spec(device=HOPPER, d=256)) == []
    assert "head_dim 256 > 128" in reasons("sdpa-cudnn", spec(device=DeviceInfo("cuda", 0, "RTX 5090", (12, 0)), d=256))
    assert "kv_len 1 not supported" in reasons("sdpa-cudnn", spec(kv=1))


def test_fa3_takes_only_head_sizes_in_multiples_of_8(monkeypatch):
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(fa, "fa3", object())
    assert fa.variant(spec(device=HOPPER, d=40)) == "FA3"
    assert fa.variant(spec(device=HOPPER, d=36)) == "FA2"  # FA2 pads odd sizes itself
    monkeypatch.setattr(fa, "fa2", None)
    assert "head_dim 36 not a multiple of 8 (FA3)" in fa.reasons(spec(device=HOPPER, d=36))


def test_xformers_refusals_keep_each_operators_reasons():
    from lib_attn.kernels.xformers import _operator_reasons
    message = ("No operator found for `memory_efficient_attention_forward` with inputs:\n"
               "     query       : shape=(2, 77, 8, 40) (torch.float32)\n"
               "`fa2F@2.5.7` is not supported because:\n"
               "    dtype=torch.float32 (supported: {torch.float16, torch.bfloat16})\n"
               "`cutlassF-pt` is not supported because:\n"
               "    attn_bias.stride(-2) % 8 != 0 (attn_bias.stride() = (0, 0, 77, 1))\n")
    assert _operator_reasons(message) == [
        "fa2F@2.5.7: dtype=torch.float32 (supported: {torch.float16, torch.bfloat16})",
        "cutlassF-pt: attn_bias.stride(-2) % 8 != 0 (attn_bias.stride() = (0, 0, 77, 1))",
    ]
