"""xformers: each release's real Python (input checks, operator dispatch, bias handling) called the
way the engine calls it, down to the CUTLASS forward operator, which gets a CPU kernel here.

Up to 0.0.27 the forward is xformers' own ``xformers::efficient_attention_forward_cutlass``
(csrc/attention/attention.cpp declares its schema; defined here with it); later releases call
PyTorch's ``aten::_efficient_attention_forward``. Either gets a CPU kernel that checks what the CUDA
kernel checks before it runs (dtypes, unit last stride, bias shape and last stride, no dropout, no
causal mask type) and computes attention in float64. The operators' device lists gain "cpu" for the
test; the rest is the release's own code.
"""
from __future__ import annotations

import math
import pathlib
import sys

import pytest

from . import isolate
from .sources import fetch

RELEASES = ["0.0.23.post1", "0.0.28.post3", "0.0.30", "0.0.33.post2", "0.0.35"]
HERE = "tools.conformance.test_xformers"

#: xformers 0.0.23.post1, csrc/attention/attention.cpp.
XFORMERS_FWD_SCHEMA = (
    "efficient_attention_forward_cutlass(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
    "Tensor? seqstart_q, Tensor? seqstart_k, int? max_seqlen_q, float dropout_p, bool compute_logsumexp, "
    "int custom_mask_type, float? scale, Tensor? seqlen_k, int? window_size) -> (Tensor, Tensor, int, int)")


@pytest.mark.parametrize("release", RELEASES)
def test_xformers_release(release):
    print(isolate.run(f"{HERE}:xformers_case", release, str(fetch("xformers", release))))


def _forward(query, key, value, bias, seqstart_q, seqstart_k, dropout_p, custom_mask_type, scale, window_size):
    import torch

    from .standins import check

    check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4, "query, key, value must be (B, M, H, K)")
    check(query.dtype == key.dtype == value.dtype, "query, key, value must have one dtype")
    for t in (query, key, value):
        check(t.stride(-1) == 1, "query, key, value must be contiguous along the last dimension")
    check(seqstart_q is None and seqstart_k is None, "the stand-in takes no block-diagonal sequences")
    check(dropout_p == 0.0 and custom_mask_type == 0 and not window_size, "no dropout, causal type or window")
    b, m, h, d = query.shape
    n = key.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bmhk,bnhk->bhmn", query.double(), key.double()) * scale
    if bias is not None:
        check(bias.dim() == 4 and tuple(bias.shape) == (b, h, m, n), f"attn_bias shape {tuple(bias.shape)} != {(b, h, m, n)}")
        check(bias.stride(-1) == 1, "attn_bias: last dimension must be contiguous")
        check(bias.dtype == query.dtype, "attn_bias must have the inputs' dtype")
        scores = scores + bias.double()
    out = torch.einsum("bhmn,bnhk->bmhk", torch.softmax(scores, dim=-1), value.double()).to(query.dtype)
    return out, torch.empty(b, h, 0, dtype=torch.float32)


def _register_cpu_kernels():
    import torch

    libs = []
    aten = torch.library.Library("aten", "IMPL")

    def aten_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None):
        out, lse = _forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, dropout_p, custom_mask_type, scale,
                            window_size)
        seed = torch.zeros((), dtype=torch.int64)
        return out, lse, seed, seed.clone(), query.shape[1], key.shape[1]

    aten.impl("_efficient_attention_forward", aten_forward, "CPU")
    libs.append(aten)
    if not hasattr(torch.ops.xformers, "efficient_attention_forward_cutlass"):
        own = torch.library.Library("xformers", "DEF")
        own.define(XFORMERS_FWD_SCHEMA)

        def xformers_forward(query, key, value, attn_bias, seqstart_q, seqstart_k, max_seqlen_q, dropout_p,
                             compute_logsumexp, custom_mask_type, scale, seqlen_k, window_size):
            out, lse = _forward(query, key, value, attn_bias, seqstart_q, seqstart_k, dropout_p, custom_mask_type,
                                scale, window_size)
            return out, lse, 0, 0

        own.impl("efficient_attention_forward_cutlass", xformers_forward, "CPU")
        libs.append(own)
    return libs


CALLS = [
    ("SD1.5 cross-attention", dict(b=2, h=8, n=64, kv=77, d=40), "float16", None, None),
    ("SD1.5 self-attention, fp32", dict(b=1, h=8, n=96, kv=96, d=40), "float32", None, None),
    ("SDXL, bf16, scale given", dict(b=2, h=10, n=48, kv=77, d=64), "bfloat16", None, 0.07),
    ("VAE, one head of 512", dict(b=1, h=1, n=64, kv=64, d=512), "float16", None, None),
    ("key-padding mask (bias)", dict(b=3, h=4, n=40, kv=77, d=64), "float16", [77, 30, 1], None),
]


def xformers_case(release: str, root: str) -> None:
    libs = _register_cpu_kernels()
    sys.path.insert(0, root)
    import torch

    # xformers picks its operator list by the build of torch (CUDA or ROCm); this process stands for
    # a CUDA build, as the GPU machine's torch is.
    torch.version.cuda = torch.version.cuda or "12.8"
    import xformers

    assert pathlib.Path(xformers.__file__).is_relative_to(root), xformers.__file__
    # What a built wheel has and a source tree lacks: its version file and its C++ library.
    xformers.__version__ = release
    xformers._has_cpp_library = True
    from xformers.ops.fmha import cutlass

    assert cutlass.FwOp.is_available(), f"{cutlass.FwOp.NAME}: operator not found ({cutlass.FwOp.OPERATOR})"
    cutlass.FwOp.SUPPORTED_DEVICES = set(cutlass.FwOp.SUPPORTED_DEVICES) | {"cpu"}

    from . import engine

    for name, sizes, dtype, keep, scale in CALLS:
        dtype = getattr(torch, dtype)
        q, k, v = engine.inputs(**sizes, dtype=dtype, seed=len(name))
        mask = None if keep is None else engine.key_padding(sizes["b"], sizes["kv"], keep)
        try:
            dec = engine.decision("xformers", q, k, v, mask, sm=86)
        except ValueError as exc:
            # Releases up to 0.0.2x ask the CUDA device itself whether it takes bf16: not here.
            if dtype is torch.bfloat16 and f"{cutlass.FwOp.NAME}: bf16 is only supported on A100+ GPUs" in str(exc):
                print(f"{release} {name}: not run (this release checks bf16 against the CUDA device)")
                continue
            raise
        assert dec.backend == "xformers", f"{name}: {dec.rejected}"
        out = dec.run(q, k, v, mask, scale)
        err = engine.check(out, q, k, v, mask, scale, what=name)
        print(f"{release} {name}: {cutlass.FwOp.NAME} {dtype} rel.err {err:.2e}")
    del libs
