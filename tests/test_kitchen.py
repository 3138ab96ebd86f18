"""comfy-kitchen's INT8 attention as the engine sees it: what it refuses and why, what the probe reads
from the installed package, and how a call reaches the kernel.

The kernel needs an NVIDIA GPU; the package's real Python runs on CPU in ``tools/conformance``
(test_comfy_kitchen.py). Here a stand-in package has the modules and names 0.2.40 has, and its
``int8_attention`` checks what the release's ``_validate_inputs`` checks and computes exact attention.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import lib_attn
from lib_attn.chains import default_chain
from lib_attn.decision import decide
from lib_attn.device import DeviceInfo
from lib_attn.kernels import REGISTRY, Status, kitchen
from lib_attn.spec import CallSpec

from engine_helpers import make_qkv, reference, rel_err

TURING = DeviceInfo("cuda", 0, "RTX 2080", (7, 5))
VOLTA = DeviceInfo("cuda", 0, "V100", (7, 0))
HOPPER = DeviceInfo("cuda", 0, "H100", (9, 0))
RDNA3 = DeviceInfo("cuda", 0, "RX 7900", None, platform="rocm", arch="gfx1100")
MI300 = DeviceInfo("cuda", 0, "MI300X", None, platform="rocm", arch="gfx942")
CPU = DeviceInfo("cpu", None, "cpu", None)


def spec(device=HOPPER, d=128, q=4096, kv=4096, dtype=torch.float16, mask="none", requires_grad=False):
    return CallSpec(device, dtype, 2, 8, q, kv, d, mask=mask, requires_grad=requires_grad)


def reasons(call, asked=False):
    return REGISTRY["ck-int8"].reasons(call, asked=asked)


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def test_it_takes_fp16_and_bf16_self_and_cross_attention_up_to_head_dim_256_from_turing():
    for device in (TURING, HOPPER):
        for dtype in (torch.float16, torch.bfloat16):
            for d, kv in ((40, 77), (64, 4096), (128, 75600), (256, 1024)):
                assert reasons(spec(device, d=d, kv=kv, dtype=dtype)) == []


def test_what_it_refuses_names_the_call_and_the_kernel():
    assert reasons(spec(VOLTA)) == ["GPU sm70 < sm75"]
    assert reasons(spec(d=512)) == ["head_dim 512 > 256"]
    assert reasons(spec(dtype=torch.float32)) == ["dtype float32 not supported (fp16/bf16)"]
    assert reasons(spec(mask="key-padding")) == ["key-padding attention mask not supported"]
    assert reasons(spec(mask="dense")) == ["dense attention mask not supported"]
    assert reasons(spec(requires_grad=True)) == ["no backward pass (inference only)"]
    assert reasons(spec(CPU)) == ["device cpu not supported (cuda only)"]
    assert reasons(spec(MI300)) == ["gfx942: comfy-kitchen's INT8 attention on AMD needs matrix cores (RDNA3 or newer: "
                                    "gfx11xx, gfx12xx)"]
    assert reasons(spec(RDNA3)) == []


def test_it_is_approximate_and_never_in_a_default_chain():
    assert REGISTRY["ck-int8"].approximate
    for device in (TURING, HOPPER, DeviceInfo("cuda", 0, "RTX 4090", (8, 9)), RDNA3):
        for role in ("unet", "dit", "vae"):
            assert "ck-int8" not in default_chain(role, device, fa3=False, cudnn=0, spec=spec(device))


def _stand_in_package(monkeypatch, *, version="0.2.40", extension=True, int8=True):
    """Modules named as comfy-kitchen 0.2.40's, with the names the probe reads; returns the calls made."""
    calls = []

    def int8_attention(q, k, v, *, scale=None, attn_mask=None):
        # What the release's _validate_inputs checks before the kernel runs.
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError("q, k, and v must have shape [batch, heads, sequence, head_dim]")
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise TypeError("q, k, and v must have the same dtype")
        if not 0 < q.shape[-1] <= 256:
            raise ValueError(f"head_dim must be in [1, 256], got {q.shape[-1]}")
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("the last dimension of q, k, and v must be contiguous")
        calls.append({"shape": tuple(q.shape), "scale": scale, "attn_mask": attn_mask})
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
        return out.to(q.dtype)

    package = types.ModuleType("comfy_kitchen")
    package.__version__ = version
    package.__path__ = []
    backends = types.ModuleType("comfy_kitchen.backends")
    backends.__path__ = []
    cuda = types.ModuleType("comfy_kitchen.backends.cuda")
    cuda._EXT_AVAILABLE = extension
    cuda._EXT_ERROR = None if extension else "Extension file not found: _C.abi3.so"
    sage = types.ModuleType("comfy_kitchen.sage_attention")
    if int8:
        sage.int8_attention = int8_attention
    for name, module in (("comfy_kitchen", package), ("comfy_kitchen.backends", backends),
                         ("comfy_kitchen.backends.cuda", cuda), ("comfy_kitchen.sage_attention", sage)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_the_probe_reads_the_version_and_says_why_the_package_cannot_serve(monkeypatch):
    backend = REGISTRY["ck-int8"]
    _stand_in_package(monkeypatch)
    found = backend._probe()
    assert found == Status(True, version="0.2.40") and callable(backend.fn)

    _stand_in_package(monkeypatch, extension=False)
    found = backend._probe()
    assert not found.available and backend.fn is None
    assert found.reason == ("comfy-kitchen 0.2.40: its compiled extension did not load (Extension file not found: "
                            "_C.abi3.so)")

    _stand_in_package(monkeypatch, version="0.2.8", int8=False)
    assert backend._probe().reason == "comfy-kitchen 0.2.8 has no sage_attention.int8_attention (0.2.40 has)"


def test_without_the_package_the_probe_names_the_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)
    found = REGISTRY["ck-int8"].probe()
    assert not found.available and "comfy_kitchen" in found.reason and found.reason.startswith("ModuleNotFoundError")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_named_call_reaches_the_kernel_in_its_layout_with_the_scale_and_no_mask(monkeypatch, layout):
    calls = _stand_in_package(monkeypatch)
    REGISTRY["ck-int8"]._probe()
    q, k, v = make_qkv(2, 5, 96, 77, 72, torch.float16, layout=layout, strided=True, seed=3)
    kept = [t.clone() for t in (q, k, v)]
    call = CallSpec(HOPPER, torch.float16, 2, 5, 96, 77, 72, layout=layout)
    dec = decide(call, ("ck-int8",), statuses={"ck-int8": Status(True, version="0.2.40")}, explicit=True)
    assert dec.backend == "ck-int8"
    out = dec.run(q, k, v, None, 0.11)
    assert calls == [{"shape": (2, 5, 96, 72), "scale": 0.11, "attn_mask": None}]
    assert out.shape == q.shape and out.dtype == torch.float16
    assert rel_err(out, reference(q, k, v, None, 0.11, layout)) < 4 * 2.0**-11
    assert all(torch.equal(a, b) for a, b in zip(kept, (q, k, v)))
