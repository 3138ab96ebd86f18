"""Shared helpers for the engine's tests: a float64 reference and relative errors."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import lib_attn
from lib_attn.kernels import REGISTRY


def reference(q, k, v, mask=None, scale=None, layout="bhsd"):
    """softmax(q k^T * scale + mask) v in float64, in the inputs' layout."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.double() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2) if layout == "bshd" else out


def naive_same_dtype(q, k, v, mask=None, scale=None, layout="bhsd"):
    """Plain PyTorch math in the inputs' own dtype: the baseline error a kernel is held to."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(scores.dtype)
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2) if layout == "bshd" else out


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def make_qkv(b, h, n, kv, d, dtype, layout="bhsd", strided=False, seed=None):
    """Fresh random q, k, v; ``strided`` gives views of a packed qkv buffer, as hosts pass them."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    if strided:
        # A (b, seq, 3, h, d) buffer viewed per tensor: non-contiguous, like Flux's permuted qkv.
        qb = torch.randn(b, n, 3, h, d, generator=gen).to(dtype)
        kb = torch.randn(b, kv, 3, h, d, generator=gen).to(dtype)
        q, k, v = qb[:, :, 0], kb[:, :, 1], kb[:, :, 2]
        if layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return q, k, v
    shape_q = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
    shape_k = (b, h, kv, d) if layout == "bhsd" else (b, kv, h, d)
    return (torch.randn(shape_q, generator=gen).to(dtype), torch.randn(shape_k, generator=gen).to(dtype),
            torch.randn(shape_k, generator=gen).to(dtype))


def spy(monkeypatch, backend_id):
    """Count the real kernel calls of one backend (decisions made after this see the spy)."""
    ran = []
    backend = REGISTRY[backend_id]
    real = backend.runner

    def runner(spec):
        kernel = real(spec)

        def run(*args):
            ran.append(1)
            return kernel(*args)
        return run
    monkeypatch.setattr(backend, "runner", runner)
    lib_attn.reset()
    return ran


SAGE_IDS = ("sage", "sage-triton", "sage-cuda", "sage-fp8", "sage-fp8pp")


def told_calls(monkeypatch) -> list:
    """(sequence length, the conditioning told) of each call that reaches ``lib_attn.attention`` from now on."""
    from lib_attn import conditioning

    seen = []
    real = lib_attn.attention

    def watching(q, k, v, *, layout="bhsd", **kwargs):
        n = q.shape[1 if layout == "bshd" else 2]
        seen.append((n, conditioning.current(n)))
        return real(q, k, v, layout=layout, **kwargs)

    monkeypatch.setattr(lib_attn, "attention", watching)
    return seen


def sage_release(version="2.2.0", **fields):
    """The facts an installed SageAttention release shows the engine (``sage_facts.read``), with stand-in
    kernels: 1.x has only its Triton kernel; a 2.x release has every kernel compiled; from 2.2.0 the
    Triton kernel masks the keys past kv_len and takes masks, and the fp8 kernel has fp16 accumulation."""
    from lib_attn.kernels import sage_facts
    from lib_attn.kernels.base import release

    def kernel(*args, **kwargs):
        raise AssertionError("a stand-in SageAttention kernel ran")

    major = release(version)[0]
    if major <= 1:
        return sage_facts.SageFacts(version, major, kernel, {"triton": kernel})
    fixed = release(version) >= (2, 2, 0)
    kinds = dict(sage_facts.FUNCTIONS)
    if release(version) < (2, 1, 0):
        kinds.pop("fp8-sm90")
    defaults = dict(
        functions={kind: kernel for kind in kinds},
        dispatch=dict(sage_facts.DISPATCH_2_0 if "fp8-sm90" not in kinds else sage_facts.DISPATCH_2_1),
        compiled=frozenset(k for k in sage_facts.COMPILED_FLAG if k in kinds),
        triton_pads_right=fixed, triton_masks=fixed, fp8_fp16_accum=fixed)
    defaults.update(fields)
    return sage_facts.SageFacts(version, major, kernel, **defaults)


def install_sage(monkeypatch, facts):
    """Every SageAttention 1/2 backend sees ``facts`` as the installed package."""
    for bid in SAGE_IDS:
        monkeypatch.setattr(REGISTRY[bid], "facts", facts)


@contextlib.contextmanager
def fresh_engine_with(monkeypatch, tmp_path, backends):
    """A fresh engine whose tuning file is the test's own, with the test backends of ``backends`` (a module
    with ``register``/``unregister``) registered while the block runs."""
    from lib_attn import tuning_file

    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path / "cache"))
    tuning_file.forget_memory()
    lib_attn.reset()
    backends.register()
    try:
        yield
    finally:
        backends.unregister()
        lib_attn.reset()
        tuning_file.forget_memory()


@pytest.fixture
def sage_on_cpu(monkeypatch):
    """SageAttention as if installed and able to run here: its stand-in kernel is exact attention, so what
    is tested is which backend a call reaches, never the kernel's numbers."""
    from lib_attn.kernels import REGISTRY, Status, reset_probes
    sage = REGISTRY["sage"]

    def kernel(q, k, v, mask, scale):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    monkeypatch.setattr(sage, "devices", ("cpu",))
    monkeypatch.setattr(sage, "dtypes", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(sage, "probe", lambda: Status(True, version="stand-in"))
    monkeypatch.setattr(sage, "extra_reasons", lambda spec, asked: [])
    monkeypatch.setattr(sage, "variant", lambda spec: "")
    monkeypatch.setattr(sage, "runner", lambda spec: kernel)
    reset_probes()
    yield
    monkeypatch.undo()
    reset_probes()



@pytest.fixture
def sage_package(monkeypatch, tmp_path):
    """``install(version)``: an importable stand-in ``sageattention`` distribution of that version, as
    pip lays one out (the package, whose ``sageattn`` is exact attention, and its metadata). Hosts that
    decide by import see it installed; the engine's probe is reset so that it reads it too. Gone after
    the test: request it before ``webui_factory``, whose end puts back the ``sys.path`` it found."""
    import os
    import sys
    from lib_attn.kernels import reset_probes

    def install(version="1.0.6"):
        package = tmp_path / "sageattention"
        package.mkdir()
        (package / "__init__.py").write_text(
            f"__version__ = {version!r}\n"
            "import torch\n\n\n"
            "def sageattn(q, k, v, tensor_layout='HND', is_causal=False, sm_scale=None, **kwargs):\n"
            "    if tensor_layout == 'NHD':\n"
            "        q, k, v = (t.transpose(1, 2) for t in (q, k, v))\n"
            "    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=sm_scale)\n"
            "    return out.transpose(1, 2) if tensor_layout == 'NHD' else out\n")
        info = tmp_path / f"sageattention-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sageattention\nVersion: {version}\n")
        monkeypatch.syspath_prepend(os.fspath(tmp_path))
        sys.modules.pop("sageattention", None)
        reset_probes()

    yield install
    monkeypatch.undo()
    while os.fspath(tmp_path) in sys.path:
        sys.path.remove(os.fspath(tmp_path))
    sys.modules.pop("sageattention", None)
    reset_probes()
