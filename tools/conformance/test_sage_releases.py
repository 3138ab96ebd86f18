"""SageAttention's own Python and Triton kernels, run on CPU under Triton's interpreter, called the way
the engine's SageAttention backends call them.

PyPI has the 1.x releases only (2.x and 3 are source builds or community wheels), so 1.0.6, what
``ATTN_INSTALL=sage`` installs, is the release checked here. Its ``sageattn`` asserts ``q.is_cuda``;
that one line is relaxed in a copy, and nothing else of the package is changed. The engine must refuse
every call the real kernel gets wrong (relative error against a float64 reference above the bound it
holds approximate kernels to) and take every call it gets right, and no call may write into the
caller's tensors.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import sys

import pytest
import torch

from .sources import fetch

os.environ.setdefault("TRITON_INTERPRET", "1")

from lib_attn import tune  # noqa: E402
from lib_attn.device import DeviceInfo  # noqa: E402
from lib_attn.kernels import REGISTRY, sage_facts  # noqa: E402
from lib_attn.spec import CallSpec  # noqa: E402

#: The bound the engine holds an approximate fp16 kernel to (tuning's output check).
BOUND = tune.BOUNDS[torch.float16] * tune.APPROXIMATE_FACTOR
RTX_3090 = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))


@pytest.fixture(scope="module")
def sage_1_0_6(tmp_path_factory):
    """sageattention 1.0.6 from PyPI, importable, with its CUDA assertion relaxed for CPU tensors."""
    pytest.importorskip("triton")
    source = fetch("sageattention", "1.0.6", kind="wheel")
    target = tmp_path_factory.mktemp("sage-1.0.6")
    for entry in os.listdir(source):
        if entry.startswith("sageattention"):
            copy = shutil.copytree if os.path.isdir(source / entry) else shutil.copy2
            copy(source / entry, target / entry)
    core = target / "sageattention" / "core.py"
    text, n = re.subn(r"assert q\.is_cuda,", "assert q.is_cuda or q.device.type == 'cpu',", core.read_text())
    assert n == 2, "sageattention 1.0.6's core.py changed: its CUDA assertions were not found"
    core.write_text(text)
    sys.path.insert(0, str(target))
    for name in [m for m in sys.modules if m == "sageattention" or m.startswith("sageattention.")]:
        del sys.modules[name]
    module = importlib.import_module("sageattention")
    facts = sage_facts.read(module)
    yield facts
    sys.path.remove(str(target))


@pytest.fixture
def engine_sees(sage_1_0_6, monkeypatch):
    for bid in ("sage", "sage-triton", "sage-cuda", "sage-fp8", "sage-fp8pp"):
        monkeypatch.setattr(REGISTRY[bid], "facts", sage_1_0_6)
    return sage_1_0_6


def test_the_installed_release_is_read_as_pypi_ships_it(engine_sees):
    assert engine_sees.version == "1.0.6" and engine_sees.major == 1
    assert engine_sees.functions == {"triton": engine_sees.sageattn}
    assert not engine_sees.triton_pads_right


def relative_error(out, q, k, v):
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bid", ["sage", "sage-triton"])
@pytest.mark.parametrize("kv", [64, 77, 100, 128, 320])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_the_engine_refuses_exactly_the_calls_the_kernel_gets_wrong(engine_sees, bid, kv, d):
    gen = torch.Generator().manual_seed(1000 * kv + d)
    q, k, v = (torch.randn(1, 2, n, d, generator=gen).half() for n in (96, kv, kv))
    kept = k.clone()
    backend = REGISTRY[bid]
    call = CallSpec(RTX_3090, torch.float16, 1, 2, 96, kv, d)
    refused = backend.reasons(call)
    out = backend.runner(call)(q, k, v, None, None)
    assert torch.equal(k, kept), "the kernel wrote into the caller's k"
    err = relative_error(out, q, kept, v)
    if refused:
        assert err > BOUND, f"{bid} refused a call it computes within {BOUND}: rel err {err:.3f} ({refused})"
        assert refused == [f"kv_len {kv} not a multiple of 64: SageAttention 1.0.6 miscomputes it (fixed in 2.2.0)"]
    else:
        assert err <= BOUND, f"{bid} took a call it gets wrong: kv_len {kv}, head_dim {d}, rel err {err:.3f}"


def test_left_alone_the_package_writes_into_the_callers_keys(engine_sees):
    """Why the backends never hand 1.0.6 the caller's k: called directly, it changes it."""
    q, k, v = (torch.randn(1, 2, 64, 64).half() for _ in range(3))
    kept = k.clone()
    engine_sees.sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    assert not torch.equal(k, kept)
