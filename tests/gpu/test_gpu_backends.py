"""GPU backends on a real CUDA device: numerics against float64, masks, layouts, fp32 casting.

Each case asks the backend for its reasons first and skips with them, so a run on any GPU says
exactly which kernels it could not exercise and why.
"""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn.kernels import REGISTRY, status
from lib_attn.spec import spec_of
from tests.engine_helpers import make_qkv, naive_same_dtype, reference, rel_err

GPU_BACKENDS = list(lib_attn.BACKEND_IDS)
SHAPES = [(8, 256, 77, 40), (8, 256, 256, 80), (8, 64, 154, 160), (10, 256, 256, 64), (24, 300, 300, 128), (1, 256, 256, 512)]


@pytest.fixture(autouse=True)
def fresh_engine():
    lib_attn.reset()
    yield
    lib_attn.reset()


def to_gpu(*ts):
    return tuple(t.cuda() for t in ts)


def skip_unless_takes(backend, q, k, v, mask=None, layout="bhsd", role="unet"):
    st = status(backend)
    if not st.available:
        pytest.skip(f"{backend}: {st.reason}")
    reasons = REGISTRY[backend].reasons(spec_of(q, k, v, mask, layout, role), asked=True)
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")


def tolerance(backend, dtype, baseline):
    # An approximate kernel (SageAttention's 8-bit or 4-bit QK^T) is bounded by its quantisation, not by rounding.
    factor = 8 if REGISTRY[backend].approximate else 2
    return factor * baseline + torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}q{}kv{}d{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_backend_matches_reference(backend, shape, dtype):
    h, n, kv, d = shape
    q, k, v = to_gpu(*make_qkv(2, h, n, kv, d, dtype))
    skip_unless_takes(backend, q, k, v)
    out = lib_attn.attention(q, k, v, backend=backend)
    assert lib_attn.explain(q, k, v, backend=backend).backend == backend
    ref = reference(q.cpu(), k.cpu(), v.cpu())
    base = rel_err(naive_same_dtype(q, k, v).cpu(), ref)
    assert rel_err(out.cpu(), ref) <= tolerance(backend, dtype, base)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_strided_layouts(backend, layout):
    q, k, v = to_gpu(*make_qkv(1, 24, 320, 320, 128, torch.bfloat16, layout=layout, strided=True))
    skip_unless_takes(backend, q, k, v, layout=layout)
    out = lib_attn.attention(q, k, v, layout=layout, backend=backend)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), layout=layout)
    base = rel_err(naive_same_dtype(q, k, v, layout=layout).cpu(), ref)
    assert rel_err(out.cpu(), ref) <= tolerance(backend, torch.bfloat16, base)


@pytest.mark.parametrize("backend", ["flash-attn", "sdpa-efficient", "sdpa-cudnn", "xformers", "sdpa", "math"])
def test_gpu_key_padding_mask(backend):
    q, k, v = to_gpu(*make_qkv(3, 8, 128, 154, 64, torch.float16))
    keep = torch.rand(3, 1, 1, 154, device="cuda") > 0.5
    keep[..., 3] = True
    skip_unless_takes(backend, q, k, v, mask=keep)
    out = lib_attn.attention(q, k, v, mask=keep, backend=backend)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), mask=keep.cpu())
    base = rel_err(naive_same_dtype(q, k, v, mask=keep).cpu(), ref)
    assert rel_err(out.cpu(), ref) <= tolerance(backend, torch.float16, base)


def test_gpu_fp32_inputs_cast_for_half_kernels():
    q, k, v = to_gpu(*make_qkv(2, 8, 256, 77, 64, torch.float32))
    d = lib_attn.explain(q, k, v)
    out = lib_attn.attention(q, k, v)
    assert out.dtype == torch.float32
    if d.cast is not None:
        assert d.cast in (torch.bfloat16, torch.float16)
    ref = reference(q.cpu(), k.cpu(), v.cpu())
    assert rel_err(out.cpu(), ref) < 2e-2
    keep = lib_attn.explain(q, k, v, fp32="keep")
    assert keep.cast is None and REGISTRY[keep.backend].takes_dtype(torch.float32, "cuda")


def test_gpu_default_choice_and_counters():
    q, k, v = to_gpu(*make_qkv(2, 10, 1024, 1024, 64, torch.float16))
    vq, vk, vv = to_gpu(*make_qkv(1, 1, 1024, 1024, 512, torch.float16))
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
        lib_attn.attention(vq, vk, vv, role="vae")
    unet = lib_attn.explain(q, k, v).backend
    vae = lib_attn.explain(vq, vk, vv, role="vae").backend
    print(f"\n{torch.cuda.get_device_name()}: unet -> {unet}, vae -> {vae}; {rec.kernels}")
    assert unet not in ("math", "sdpa-math") and vae not in ("math", "sdpa-math")
    assert rec.calls == {("unet", unet): 1, ("vae", vae): 1}
    assert not torch.isnan(lib_attn.attention(q, k, v)).any()


SAGE_BACKENDS = [bid for bid in lib_attn.BACKEND_IDS if bid.startswith("sage")]


@pytest.mark.parametrize("backend", SAGE_BACKENDS)
@pytest.mark.parametrize("kv", [77, 100, 4096])
def test_gpu_sage_calls_are_right_or_refused_and_leave_the_caller_as_it_was(backend, kv):
    """SD cross-attention (77 keys) and a self-attention call: a SageAttention release either refuses
    the call with its reason or computes it within its bound; the caller's k and current device stay."""
    q, k, v = to_gpu(*make_qkv(2, 10, 4096, kv, 64, torch.float16))
    skip_unless_takes(backend, q, k, v)
    kept, device = k.clone(), torch.cuda.current_device()
    out = REGISTRY[backend].runner(spec_of(q, k, v, None, "bhsd", "unet"))(q, k, v, None, None)
    torch.cuda.synchronize()
    assert torch.equal(k, kept) and torch.cuda.current_device() == device
    ref = reference(q.cpu(), kept.cpu(), v.cpu())
    base = rel_err(naive_same_dtype(q, kept, v).cpu(), ref)
    assert rel_err(out.cpu(), ref) <= tolerance(backend, torch.float16, base)
