"""comfy-kitchen's released Python, called the way the engine calls it.

The wheel of each release (PyPI; it imports on a machine without a GPU) is unpacked and put on the path
in a fresh interpreter.

* INT8 attention (``ck-int8``): ``sage_attention.int8_attention`` runs its own checks, head-size
  padding, buffer sizing and output slicing; what only a GPU has is stood in, as the flash-attn cases
  stand in its compiled module: the compiled ``sage_sdpa`` (taking exactly the arguments the release's
  Python passes, checking what those buffers must be, and computing exact attention from the padded
  inputs), the CUDA stream, ``is_available`` for an sm``SM`` GPU, and the one check that the tensors
  live on a GPU (relaxed in a copy of the file, as SageAttention's is in test_sage_releases.py).
"""
from __future__ import annotations

import math
import pathlib
import re
import shutil
import sys
import tempfile
import types

import pytest

from . import isolate
from .sources import fetch

RELEASES = ("0.2.40",)
HERE = "tools.conformance.test_comfy_kitchen"


@pytest.mark.parametrize("release", RELEASES)
def test_int8_attention_release(release):
    print(isolate.run(f"{HERE}:int8_case", release, str(fetch("comfy-kitchen", release, kind="wheel"))))


# --- the cases, each in its own interpreter -------------------------------------------------------

def _importable_copy(root: str) -> pathlib.Path:
    """The unpacked wheel copied, with the GPU-residence check of int8 attention's input validation
    relaxed to accept CPU tensors; nothing else of the package is changed."""
    target = pathlib.Path(tempfile.mkdtemp()) / "site"
    shutil.copytree(root, target)
    path = target / "comfy_kitchen" / "sage_attention.py"
    text, n = re.subn(r"if not q\.is_cuda or ", "if q.device.type not in ('cuda', 'cpu') or ", path.read_text())
    assert n == 1, "comfy-kitchen's sage_attention.py changed: its q.is_cuda check was not found"
    path.write_text(text)
    sys.path.insert(0, str(target))
    return target


def _sage_sdpa_stand_in(torch, dtype_codes, calls):
    """The compiled ``sage_sdpa`` as the release's Python calls it: 17 positional arguments."""
    by_code = {code: dtype for dtype, code in dtype_codes.items()}

    def sage_sdpa(q, k, v, output, q_int8, q_scale, k_int8, k_scale, v_int8, v_scale, attention_scale,
                  in_code, out_code, stream, anchor_ptr, attn_mask, cta_k):
        q, k, v, output, q_int8, k_int8, v_int8 = (torch.from_dlpack(t) for t in (q, k, v, output, q_int8, k_int8,
                                                                                  v_int8))
        b, h, n, d = q.shape
        kv = k.shape[2]
        assert d in (64, 128, 256), f"kernel head dim {d}"
        assert q.dtype == k.dtype == v.dtype == by_code[in_code], (q.dtype, in_code)
        assert output.dtype == by_code[out_code] and output.shape == (b, h, n, d), (output.dtype, output.shape)
        assert q_int8.dtype == k_int8.dtype == v_int8.dtype == torch.int8
        assert q_int8.shape == q.shape and k_int8.shape == k.shape
        assert cta_k in (64, 128) and v_int8.shape == (b * k.shape[1] * d, math.ceil(kv / cta_k) * cta_k)
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "a kernel input without unit last stride"
        assert isinstance(attention_scale, float) and math.isfinite(attention_scale)
        assert isinstance(stream, int) and isinstance(anchor_ptr, int)
        calls.append({"d": d, "scale": attention_scale, "mask": attn_mask is not None, "cta_k": cta_k})
        scores = (q.double() @ k.double().transpose(-1, -2)) * attention_scale
        output.copy_((scores.softmax(-1) @ v.double()).to(output.dtype))

    return sage_sdpa


#: (name, sizes, dtype, layout, scale): the calls SD models make, and a DiT's.
INT8_CALLS = [
    ("SD1.5 cross-attention", dict(b=2, h=8, n=64, kv=77, d=40), "float16", "bhsd", None),
    ("SD1.5 self-attention", dict(b=2, h=8, n=96, kv=96, d=80), "float16", "bhsd", None),
    ("SD1.5 top level, bf16", dict(b=1, h=8, n=64, kv=64, d=160), "bfloat16", "bhsd", None),
    ("SDXL, ComfyUI layout", dict(b=2, h=10, n=64, kv=77, d=64), "float16", "bshd", None),
    ("SDXL, scale given", dict(b=2, h=10, n=48, kv=48, d=64), "bfloat16", "bhsd", 0.07),
    ("Flux/Wan head, long keys", dict(b=1, h=2, n=64, kv=1100, d=128), "bfloat16", "bshd", None),
    ("head size 256", dict(b=1, h=2, n=40, kv=50, d=256), "float16", "bhsd", 0.05),
]


def int8_case(release: str, root: str) -> None:
    import torch

    _importable_copy(root)
    import comfy_kitchen
    from comfy_kitchen import sage_attention
    from comfy_kitchen.backends import cuda as cuda_backend

    assert pathlib.Path(sage_attention.__file__).is_relative_to(sys.path[0]), sage_attention.__file__
    sm = 89
    calls = []
    cuda_backend._C = types.SimpleNamespace(sage_sdpa=_sage_sdpa_stand_in(torch, sage_attention.DTYPE_TO_CODE, calls))
    sage_attention.is_available = lambda device=None: (cuda_backend._EXT_AVAILABLE and
                                                       (sm // 10, sm % 10) >= sage_attention._NATIVE_MINIMUM_CAPABILITY)
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)

    from lib_attn import kernels

    from . import engine

    for name, sizes, dtype, layout, scale in INT8_CALLS:
        dtype = getattr(torch, dtype)
        q, k, v = engine.inputs(**sizes, dtype=dtype, layout=layout, seed=len(name))
        before = [t.clone() for t in (q, k, v)]
        dec = engine.decision("ck-int8", q, k, v, sm=sm, layout=layout)
        assert dec.backend == "ck-int8", (name, dec.backend)
        out = dec.run(q, k, v, None, scale)
        d = sizes["d"]
        want_scale = 1 / math.sqrt(d) if scale is None else scale
        assert calls[-1]["d"] == (64 if d <= 64 else 128 if d <= 128 else 256), (name, calls[-1])
        assert math.isclose(calls[-1]["scale"], want_scale, rel_tol=1e-12) and not calls[-1]["mask"], (name, calls[-1])
        err = engine.check(out, q, k, v, None, scale, layout, what=name)
        assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), f"{name}: the call wrote to q, k or v"
        print(f"{name}: {dtype} kernel head {calls[-1]['d']} cta_k {calls[-1]['cta_k']} rel.err {err:.2e}")
    assert kernels.status("ck-int8").version == release, kernels.status("ck-int8")
    assert comfy_kitchen.sol_attn is not None

    # What the engine refuses, the release's own checks refuse too (and the reverse holds above).
    q, k, v = engine.inputs(b=1, h=1, n=16, kv=16, d=320, dtype=torch.float16)
    try:
        engine.decision("ck-int8", q, k, v, sm=sm)
    except ValueError as exc:
        assert "head_dim 320 > 256" in str(exc), exc
    else:
        raise AssertionError("the engine took a head size of 320")
    try:
        sage_attention.int8_attention(q, k, v)
    except ValueError as exc:
        assert "head_dim must be in [1, 256], got 320" in str(exc), exc
    else:
        raise AssertionError("comfy-kitchen took a head size of 320: the engine's limit is out of date")
    print(f"comfy-kitchen {release}: {len(INT8_CALLS)} calls through its Python, head size 320 refused by both")
