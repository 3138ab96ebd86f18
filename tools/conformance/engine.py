"""How a conformance case calls the engine: the dispatcher's own decision for one named backend,
on a stand-in NVIDIA device, then the call through the real package's Python, compared with SDPA.

The tensors live on the CPU; the backend decides as it would on a GPU of the given architecture
(``sm``), and ``decide`` wraps its kernel call exactly as ``attention`` does (layout, cast).
"""
from __future__ import annotations

import sys
from dataclasses import replace

import torch

from .sources import ROOT

for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from lib_attn import kernels  # noqa: E402
from lib_attn.device import DeviceInfo  # noqa: E402
from lib_attn.decision import decide  # noqa: E402
from lib_attn.kernels.base import Status  # noqa: E402
from lib_attn.spec import spec_of  # noqa: E402
from engine_helpers import reference  # noqa: E402 - the engine tests' float64 attention

#: Relative error (max |out - ref| / max |ref|) allowed per dtype against a float64 reference. fp16
#: and bf16 keep 11 and 8 significand bits; the inputs are rounded to the dtype before the
#: reference sees them, so this bounds the kernel path's own rounding, not the input's.
BOUNDS = {torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8, torch.float32: 1e-5}


def loaded(backend_id: str) -> Status:
    """Probe the backend (importing the package under test); fail unless it loaded, CUDA aside."""
    kernels.reset_probes()
    st = kernels.status(backend_id)
    if not st.available and not st.reason.startswith("no CUDA device"):
        raise AssertionError(f"{backend_id} did not load: {st.reason}")
    return st


def decision(backend_id: str, q, k, v, mask=None, *, sm: int = 90, layout: str = "bhsd"):
    """The dispatcher's Decision for this call with ``backend_id`` named by the user, on an sm``sm`` GPU."""
    st = loaded(backend_id)
    device = DeviceInfo("cuda", 0, f"stand-in sm{sm}", (sm // 10, sm % 10))
    spec = replace(spec_of(q, k, v, mask, layout, "unet"), device=device)
    return decide(spec, (backend_id,), statuses={backend_id: Status(True, version=st.version)}, explicit=True)


def inputs(b=2, h=5, n=64, kv=77, d=40, dtype=torch.float16, layout="bhsd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = ((b, h, n, d), (b, h, kv, d)) if layout == "bhsd" else ((b, n, h, d), (b, kv, h, d))
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_kv, shape_kv))
    return q, k, v


def key_padding(b: int, kv: int, keep: list[int]) -> torch.Tensor:
    """A (b, 1, 1, kv) boolean mask keeping the first keep[i] keys of batch item i."""
    mask = torch.zeros(b, 1, 1, kv, dtype=torch.bool)
    for i, n in enumerate(keep):
        mask[i, ..., :n] = True
    return mask


def sdpa_fp32(q, k, v, mask=None, scale=None, layout="bhsd") -> torch.Tensor:
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kwargs = {} if scale is None else {"scale": scale}
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, **kwargs)
    return out.transpose(1, 2) if layout == "bshd" else out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def check(out, q, k, v, mask=None, scale=None, layout="bhsd", what="") -> float:
    """Assert ``out`` has the call's shape and dtype and is within the dtype's bound of the float64
    reference; fp32 SDPA must be too (it is the engine's own baseline). Returns the error."""
    assert isinstance(out, torch.Tensor), f"{what}: the call returned {type(out).__name__}, not a tensor"
    assert out.shape == q.shape[:-1] + (v.shape[-1],), f"{what}: output shape {tuple(out.shape)} for q {tuple(q.shape)}"
    assert out.dtype == q.dtype, f"{what}: output dtype {out.dtype}, inputs {q.dtype}"
    ref = reference(q, k, v, mask, scale, layout)
    bound = BOUNDS[q.dtype]
    err = relative_error(out, ref)
    base = relative_error(sdpa_fp32(q, k, v, mask, scale, layout), ref)
    assert base < BOUNDS[torch.float32], f"fp32 SDPA itself is off by {base:.2e}"
    assert err <= bound, f"{what}: relative error {err:.3e} against float64 attention > {bound:.1e} ({q.dtype})"
    return err
