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

import os
import re
import shutil
import sys

import pytest
import torch

from . import engine
from .sources import fetch

os.environ.setdefault("TRITON_INTERPRET", "1")

from lib_attn import check  # noqa: E402
from lib_attn.device import DeviceInfo  # noqa: E402
from lib_attn import kernels  # noqa: E402
from lib_attn.kernels import REGISTRY  # noqa: E402
from lib_attn.spec import CallSpec  # noqa: E402

#: The bound the engine holds an approximate fp16 kernel to (tuning's output check).
BOUND = check.BOUNDS[torch.float16] * check.APPROXIMATE_FACTOR
RTX_3090 = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))


@pytest.fixture(scope="module")
def sage_1_0_6(tmp_path_factory):
    """sageattention 1.0.6 from PyPI, importable, with its CUDA assertion relaxed for CPU tensors."""
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
    yield target
    sys.path.remove(str(target))
    kernels.reset_probes()


@pytest.fixture
def engine_sees(sage_1_0_6):
    """The backends' own probe of the package on the path (no CUDA device: the call decides as on a GPU)."""
    engine.loaded("sage")
    return REGISTRY["sage"].facts


def test_the_installed_release_is_read_as_pypi_ships_it(engine_sees):
    assert engine_sees.version == "1.0.6" and engine_sees.major == 1
    assert engine_sees.functions == {"triton": engine_sees.sageattn}
    assert not engine_sees.triton_pads_right


def relative_error(out, q, k, v):
    """As tuning's output check measures it: the relative L2 error against float64 attention."""
    ref = engine.reference(q, k, v)
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("bid", ["sage", "sage-triton"])
@pytest.mark.parametrize("kv", [64, 77, 100, 128, 320])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_the_engine_refuses_exactly_the_calls_the_kernel_gets_wrong(engine_sees, bid, kv, d):
    q, k, v = engine.inputs(b=1, h=2, n=96, kv=kv, d=d, seed=1000 * kv + d)
    kept = k.clone()
    try:
        decision, refused = engine.decision(bid, q, k, v, sm=86), None
        out = decision.run(q, k, v, None, None)
    except ValueError as exc:  # the dispatcher's refusal, with the backend's reasons
        refused = str(exc)
        out = REGISTRY[bid].runner(CallSpec(RTX_3090, torch.float16, 1, 2, 96, kv, d))(q, k, v, None, None)
    assert torch.equal(k, kept), "the kernel wrote into the caller's k"
    err = relative_error(out, q, kept, v)
    if refused:
        assert err > BOUND, f"{bid} refused a call it computes within {BOUND}: rel err {err:.3f} ({refused})"
        assert f"kv_len {kv} not a multiple of 64: SageAttention 1.0.6 miscomputes it (fixed in 2.2.0)" in refused
    else:
        assert decision.backend == bid
        assert err <= BOUND, f"{bid} took a call it gets wrong: kv_len {kv}, head_dim {d}, rel err {err:.3f}"


def test_left_alone_the_package_writes_into_the_callers_keys(engine_sees):
    """Why the backends never hand 1.0.6 the caller's k: called directly, it changes it."""
    q, k, v = (torch.randn(1, 2, 64, 64).half() for _ in range(3))
    kept = k.clone()
    engine_sees.sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    assert not torch.equal(k, kept)


@pytest.fixture
def raw_sage(engine_sees, tmp_path, monkeypatch):
    """SageAttention 1.0.6 registered as a backend that takes every call, unprotected: the guard alone
    stands between its faults and the caller. ``protect``: hand it a copy of k (its write then stays
    in the copy), so that its output is what the check sees."""
    import lib_attn
    from lib_attn import tuning_file

    class RawSage(lib_attn.Backend):
        id, label, approximate = "raw-sage", "sageattn 1.0.6, unprotected", True
        devices, dtypes = ("cpu",), (torch.float16,)
        protect = False

        def run(self, q, k, v, mask, scale):
            k = k.clone() if self.protect else k
            return engine_sees.sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale)

    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path))
    tuning_file.forget_memory()
    lib_attn.reset()
    lib_attn.register_backend(RawSage())
    yield RawSage
    lib_attn.unregister_backend("raw-sage")
    lib_attn.reset()
    tuning_file.forget_memory()


@pytest.mark.parametrize("tune_mode", ["off", "on"])
@pytest.mark.parametrize("n", [96, 700])  # a call probed whole, and one probed on a part
def test_the_guard_catches_the_real_kernel_on_its_first_call_and_the_callers_tensors_stay_as_they_were(
        raw_sage, n, tune_mode):
    import lib_attn
    from lib_attn import tuning_file

    lib_attn.configure(preference=["raw-sage"], tune=tune_mode)
    q, k, v = engine.inputs(b=1, h=2, n=n, kv=77, d=64, seed=n)
    kept = tuple(t.clone() for t in (q, k, v))
    out = lib_attn.attention(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), kept)), "the kernel wrote into the caller's tensors"
    d = lib_attn.explain(q, k, v)
    assert d.backend == "sdpa" and d.reasons_for("raw-sage") == ["output check failed: wrote into its inputs"]
    assert relative_error(out, q, k, v) < check.BOUNDS[torch.float16]

    # Its padding fault alone (the write kept in a copy): caught on the first call too, by its error.
    raw_sage.protect = True
    tuning_file.clear()  # the rejection above is remembered for this signature
    lib_attn.reset()
    lib_attn.configure(preference=["raw-sage"], tune=tune_mode)
    q, k, v = engine.inputs(b=1, h=2, n=n, kv=77, d=64, seed=n + 1)
    out = lib_attn.attention(q, k, v)
    (reason,) = lib_attn.explain(q, k, v).reasons_for("raw-sage")
    err, bound = (float(x) for x in reason.split("rel err ")[1].split(" > "))
    assert err > 0.2 and bound == BOUND
    assert relative_error(out, q, k, v) < check.BOUNDS[torch.float16]
    # ... and where it computes right (kv a multiple of 64), it serves the call.
    q, k, v = engine.inputs(b=1, h=2, n=n, kv=128, d=64, seed=n + 2)
    out = lib_attn.attention(q, k, v)
    assert lib_attn.explain(q, k, v).backend == "raw-sage" and relative_error(out, q, k, v) <= BOUND
