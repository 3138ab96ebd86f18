"""Every CPU-runnable backend against a float64 reference, on the shapes the models use."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import _compat
from lib_attn.kernels import math as math_backend
from tests.engine_helpers import make_qkv, naive_same_dtype, reference, rel_err

CPU_BACKENDS = ["sdpa", "sdpa-flash", "sdpa-math", "math"]
# (heads, q_len, kv_len, head_dim): SD1.5 levels (40/80/160, 77 and 154 keys), SDXL/SD2 (64),
# Flux (128, joint self), the VAE's single 512-wide head.
SHAPES = [
    (3, 64, 77, 40),
    (3, 64, 64, 40),
    (2, 48, 154, 80),
    (2, 16, 77, 160),
    (2, 32, 32, 64),
    (2, 40, 40, 128),
    (1, 64, 64, 512),
]


@pytest.fixture(autouse=True)
def fresh_engine():
    lib_attn.reset()
    yield
    lib_attn.reset()


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs the engine allocates itself start as NaN, so an element left unwritten fails."""
    def nan_output(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(math_backend, "new_output", nan_output)


def bound(dtype, baseline_err):
    # At most twice the error plain PyTorch math makes in the same dtype, plus one ulp of slack.
    return 2 * baseline_err + torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}q{}kv{}d{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_float64_reference(backend, shape, dtype, poisoned):
    h, n, kv, d = shape
    q, k, v = make_qkv(2, h, n, kv, d, dtype)
    assert lib_attn.explain(q, k, v, backend=backend).backend == backend
    out = lib_attn.attention(q, k, v, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = reference(q, k, v)
    assert rel_err(out, ref) <= bound(dtype, rel_err(naive_same_dtype(q, k, v), ref))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_layouts_and_strided_views(backend, layout, strided, poisoned):
    q, k, v = make_qkv(2, 3, 50, 77, 40, torch.float32, layout=layout, strided=strided)
    assert q.is_contiguous() is not strided
    out = lib_attn.attention(q, k, v, layout=layout, backend=backend)
    assert out.shape == q.shape
    ref = reference(q, k, v, layout=layout)
    assert rel_err(out, ref) <= bound(torch.float32, rel_err(naive_same_dtype(q, k, v, layout=layout), ref))


def key_padding_mask(b, kv, gen):
    # Any padding pattern, not only right padding; every row keeps at least one key.
    keep = torch.rand(b, 1, 1, kv, generator=gen) > 0.4
    keep[..., 0] = True
    return keep


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["key-padding", "dense-bool", "dense-float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masks(backend, kind, dtype, poisoned):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v = make_qkv(2, 3, 40, 77, 64, dtype)
    if kind == "key-padding":
        mask = key_padding_mask(2, 77, gen)
    elif kind == "dense-bool":
        mask = torch.rand(2, 3, 40, 77, generator=gen) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(1, 3, 40, 77, generator=gen).to(dtype)
    out = lib_attn.attention(q, k, v, mask=mask, backend=backend)
    decision = lib_attn.explain(q, k, v, mask=mask, backend=backend)
    if backend == "sdpa-flash" and not _compat.CPU_FLASH_TAKES_MASK:
        # torch before 2.3: the CPU flash kernel takes no mask, so the call falls back, saying why.
        assert decision.backend == "sdpa" and decision.fallback
        assert any("attention mask" in r and "takes no mask" in r for r in decision.reasons_for("sdpa-flash"))
    else:
        assert decision.backend == backend
    ref = reference(q, k, v, mask=mask)
    assert rel_err(out, ref) <= bound(dtype, rel_err(naive_same_dtype(q, k, v, mask=mask), ref))


def test_explicit_scale_is_used():
    q, k, v = make_qkv(1, 2, 16, 16, 40, torch.float64)
    for backend in CPU_BACKENDS:
        out = lib_attn.attention(q, k, v, scale=0.3, backend=backend)
        assert rel_err(out, reference(q, k, v, scale=0.3)) < 1e-10, backend


def test_math_chunks_cover_every_query(monkeypatch, poisoned):
    # Force many small chunks, with a remainder, so the chunk loop is what gets tested.
    monkeypatch.setattr(math_backend, "CHUNK_BYTES", 2 * 3 * 77 * 4 * 7)
    q, k, v = make_qkv(2, 3, 50, 77, 40, torch.float32)
    out = lib_attn.attention(q, k, v, backend="math")
    assert rel_err(out, reference(q, k, v)) < 1e-5


def test_math_backward_matches_reference():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 24, 30, 40, torch.float64))
    assert lib_attn.explain(q, k, v, backend="math").backend == "math"
    lib_attn.attention(q, k, v, backend="math").sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference(q, k, v).sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert rel_err(got, want) < 1e-10


def test_cpu_default_is_pytorch_sdpa_for_sd_shapes():
    # On CPU, SDPA's own dispatch runs its flash kernel for these calls: the default chain leads with it.
    for h, n, kv, d in SHAPES:
        q, k, v = make_qkv(2, h, n, kv, d, torch.float32)
        decision = lib_attn.explain(q, k, v)
        assert decision.backend == "sdpa" and not decision.rejected
    assert torch._fused_sdp_choice(*make_qkv(2, 8, 64, 77, 40, torch.float32)) == 1  # FLASH_ATTENTION
