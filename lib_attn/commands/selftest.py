"""The self-test of one installed kernel: the backend itself on a few calls of the shapes the hosts make,
strictly (no fallback, no guard standing in for it), against a float64 reference.

The installer runs it right after installing a kernel (``host_attn/install``) and removes the kernel when it
fails, quoting the kernel's own error. A test that cannot fail would let a kernel that raises on this GPU
(``no kernel image is available``) or computes the wrong attention stay installed: so every call here runs on
the named backend or the test fails, and its output is compared with exact attention in float64.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

import lib_attn
from lib_attn import check
from lib_attn.kernels import REGISTRY
from lib_attn.kernels.base import failure_text

#: (batch, heads, q_len, kv_len, head_dim) the hosts' calls have: SD1.5 self-attention (head dim 40) and
#: cross-attention over CLIP's 77 tokens, SDXL's head dim 64 over 1,024 tokens, a DiT's head dim 128.
SHAPES = ((2, 8, 1024, 1024, 40), (2, 8, 1024, 77, 40), (1, 10, 1024, 1024, 64), (1, 24, 512, 512, 128))


@dataclass
class Result:
    """``passed``; ``calls``: the shapes the kernel ran, each with its error; ``skipped``: shapes the
    backend does not take, each with its reasons; ``text``: one line saying what happened."""

    passed: bool
    text: str
    calls: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


def reference(q, k, v) -> torch.Tensor:
    """Exact attention in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


def run(backend: str, device: str = "cuda", dtype: torch.dtype = torch.float16, shapes=SHAPES) -> Result:
    """Run ``backend`` strictly on ``shapes`` on ``device`` and compare each output with float64 attention,
    held to the guard's bound for the dtype (its approximate bound for an approximate kernel)."""
    if backend not in REGISTRY:
        return Result(False, f"unknown backend {backend!r} (valid ids: {', '.join(lib_attn.BACKEND_IDS)})")
    kernel = REGISTRY[backend]
    where = torch.device(device)
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else where.type
    limit = check.bound(dtype, where.type, kernel.approximate)
    gen = torch.Generator(device="cpu").manual_seed(0)
    result, variant = Result(False, ""), ""
    for b, h, n, kv, d in shapes:
        q = torch.randn(b, h, n, d, generator=gen).to(where, dtype)
        k = torch.randn(b, h, kv, d, generator=gen).to(where, dtype)
        v = torch.randn(b, h, kv, d, generator=gen).to(where, dtype)
        decision = lib_attn.explain(q, k, v, backend=backend)
        if decision.backend != backend:
            why = "; ".join(", ".join(r) for bid, r in decision.rejected if bid == backend)
            result.skipped.append(((b, h, n, kv, d), why))
            continue
        variant = variant or decision.variant
        try:
            with lib_attn.use(strict=True, guard="off", tune="off"):
                out = lib_attn.attention(q, k, v, backend=backend)
        except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is the finding
            kernel_error = exc.__cause__ or exc   # strict mode's error wraps the kernel's own
            result.text = f"{backend} raised on a {b}x{h}x{n}x{kv}x{d} call on {name}: {failure_text(kernel_error)}"
            return result
        ref = reference(q, k, v)
        got = out.double()
        if not bool(torch.isfinite(got).all()):
            result.text = f"{backend} gave non-finite values on a {b}x{h}x{n}x{kv}x{d} call on {name}"
            return result
        err = float((got - ref).norm() / ref.norm())
        result.calls.append(((b, h, n, kv, d), err))
        if err > limit:
            result.text = (f"{backend} is wrong on a {b}x{h}x{n}x{kv}x{d} call on {name}: relative error "
                           f"{err:.1e} against float64, more than {limit:.1e}")
            return result
    if not result.calls:
        why = "; ".join(dict.fromkeys(reasons for _, reasons in result.skipped))
        result.text = f"the engine gives {backend} none of the test calls on {name} ({why})"
        return result
    label = f"{backend} ({variant})" if variant else backend
    worst = max(err for _, err in result.calls)
    result.passed = True
    result.text = (f"{label} ran {len(result.calls)} test calls on {name}: worst relative error {worst:.1e} "
                   f"against float64 (bound {limit:.1e})")
    if result.skipped:
        result.text += f"; {len(result.skipped)} shapes it does not take were left out"
    return result


def main(argv) -> int:
    """``selftest BACKEND [DEVICE]``: prints one line; exits 0 (passed), 4 (failed) or 0 with "skipped"
    when the device is a GPU and there is none."""
    backend = argv[0]
    device = argv[1] if len(argv) > 1 else "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    result = run(backend, device)
    print(result.text)
    return 0 if result.passed else 4


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
