"""comfy-kitchen's released Python, called the way the engine calls it.

The wheel of each release (PyPI; it imports on a machine without a GPU) is unpacked and put on the path
in a fresh interpreter.

* INT8 attention (``ck-int8``): ``sage_attention.int8_attention`` runs its own checks, head-size
  padding, buffer sizing and output slicing; what only a GPU has is stood in, as the flash-attn cases
  stand in its compiled module: the compiled ``sage_sdpa`` (taking exactly the arguments the release's
  Python passes, checking what those buffers must be, and computing exact attention from the padded
  inputs), the CUDA stream, ``is_available`` for an sm``SM`` GPU, and the one check that the tensors
  live on a GPU (relaxed in a copy of the file, as SageAttention's is in test_sage_releases.py).
* Sol-Attn (``sol``): nothing is stood in. On a CPU ``comfy_kitchen.sol_attn`` runs the package's eager
  reference, the algorithm its compiled kernels implement; the engine's calls (its layouts, scale, knob
  and the sinks of a conditioning prefix) must give what ``sol_attn`` called directly gives for the same
  arguments, the share of blocks the engine reports must be that of the package's own routing, and the
  error of the algorithm against float64 attention is measured on inputs with local structure and on
  random ones.
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


@pytest.mark.parametrize("release", RELEASES)
def test_sol_attn_release(release):
    print(isolate.run(f"{HERE}:sol_case", release, str(fetch("comfy-kitchen", release, kind="wheel")), timeout=900))


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


# --- Sol-Attn --------------------------------------------------------------------------------------

def _local(t_grid, heads, seed):
    """(1, T, heads, 128) q, k, v whose attention is local, as a video model's is: q and k hold the same
    smooth function of each token's place on a (frames, height, width) grid (cosines of each coordinate
    at wavelengths from 2 to the axis' length) plus noise of the same size; v is noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    axes = torch.stack(torch.meshgrid(*[torch.arange(n, dtype=torch.float64) for n in t_grid], indexing="ij"), -1)
    coords = axes.reshape(-1, len(t_grid))
    per_axis = 128 // (2 * len(t_grid))
    waves = [torch.logspace(0, math.log10(max(n, 2)), per_axis, dtype=torch.float64) for n in t_grid]
    feats = torch.cat([f(coords[:, i:i + 1] * math.pi / waves[i]) for i in range(len(t_grid)) for f in (torch.cos,
                                                                                                     torch.sin)], 1)
    feats = torch.nn.functional.pad(feats, (0, 128 - feats.shape[1])) * (1.2 * 128 ** 0.5 / feats.shape[1] ** 0.5)
    t = coords.shape[0]

    def proj(position):
        x = torch.randn(1, t, heads, 128, generator=g, dtype=torch.float64)
        return (x + feats[None, :, None, :] if position else x).float()

    return proj(True), proj(True), proj(False)


def _rel_l2(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _exact(q, k, v, scale=None, keep=None):
    """float64 attention over (B, T, H, D) tensors, only over the token pairs ``keep`` allows when given."""
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    s = (qh @ kh.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


def sol_case(release: str, root: str) -> None:
    import torch

    sys.path.insert(0, root)
    import comfy_kitchen

    from lib_attn import conditioning
    from lib_attn.kernels import REGISTRY, sol
    from lib_attn.kernels.sparse import Knob

    from . import engine

    assert pathlib.Path(comfy_kitchen.__file__).is_relative_to(root), comfy_kitchen.__file__
    assert engine.loaded("sol").version == release
    backend = REGISTRY["sol"]
    assert not comfy_kitchen.sol_attn_is_available(torch.device("cpu"))  # the eager reference serves a CPU

    # The engine's calls against sol_attn called directly with the same arguments.
    cases = [("bf16, ComfyUI layout, default tau", "bshd", torch.bfloat16, None, None, 0),
             ("bf16, (b, h, s, d) views, scale given", "bhsd", torch.bfloat16, 0.07, None, 0),
             ("fp32 (a CPU's), tau 1.3", "bhsd", torch.float32, None, Knob("threshold", 1.3), 0),
             ("bf16, top-k 20%, 300 text tokens first", "bshd", torch.bfloat16, None, Knob("topk", 0.2), (300, "first")),
             ("fp16, tau 0.5, text of one block first", "bhsd", torch.float16, 0.1, Knob("threshold", 0.5), (64, "first")),
             ("bf16, tau 1.3, 200 text tokens last", "bshd", torch.bfloat16, None, Knob("threshold", 1.3), (200, "last"))]
    for name, layout, dtype, scale, knob, (tokens, side) in ((*c[:5], c[5] or (0, "first")) for c in cases):
        q, k, v = engine.inputs(b=2, h=3, n=1000, kv=1000, d=128, dtype=dtype, layout=layout, seed=len(name))
        before = [x.clone() for x in (q, k, v)]
        as_bshd = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(1, 2))
        span = [0, math.ceil(tokens / 64)] if side == "first" else [(1000 - tokens) // 64, math.ceil(1000 / 64)]
        direct_args = {"scale": scale, "sink_blocks": span if tokens else None, "sink_q": span if tokens else None}
        if knob is None or knob.name == "threshold":
            direct_args["tau"] = knob.value if knob else sol.DEFAULT_TAU
        else:
            direct_args["topk_ratio"] = knob.value
        direct = comfy_kitchen.sol_attn(*(as_bshd(x) for x in (q, k, v)), **direct_args)
        with conditioning.text(tokens, total=1000, side=side):
            if knob is None:  # the dispatcher's own call: the backend named, in its layout, at its default
                dec = engine.decision("sol", q, k, v, sm=90, layout=layout)
                assert dec.backend == "sol", (name, dec.backend)
                out = dec.run(q, k, v, None, scale)
                out = as_bshd(out)
            else:
                result = backend.run_sparse(*(as_bshd(x) for x in (q, k, v)), scale, knob)
                out = result.out
                assert result.lse is None and 0 < result.share() <= 1
        assert out.dtype == dtype and out.shape == direct.shape, (name, out.dtype, out.shape)
        assert torch.equal(out, direct), f"{name}: the engine's call differs from sol_attn's own"
        assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), f"{name}: the call wrote to q, k or v"
        print(f"{name}: same output as comfy_kitchen.sol_attn({', '.join(f'{a}={b}' for a, b in direct_args.items())})")

    # Through the engine with sparse attention on: the call goes to sol (named, so its eager reference runs
    # on this CPU), at the setting given, and gives sol_attn's own output.
    import lib_attn

    q, k, v = _local((2, 16, 16), 2, seed=3)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))       # as a host passes them: (b, h, s, d) views
    direct = comfy_kitchen.sol_attn(q, k, v, tau=1.0)
    with lib_attn.use(sparse="sol, budget=1, min_tokens=256, threshold=1.0, dense=none, calibrate=off"):
        with lib_attn.recording() as rec:
            out = lib_attn.attention(qh, kh, vh, role="dit")
    report = lib_attn.Report.from_recording(rec)
    assert report.sparse is not None and report.sparse.calls == 1, report.sparse
    assert torch.allclose(out.transpose(1, 2), direct, rtol=0, atol=1e-6), "the engine's sparse call is not sol_attn's"
    print(f"through lib_attn.attention: sol at tau 1.0, {report.sparse.calls} sparse call, same output as sol_attn")

    # The share of blocks the engine reports is the package's routing: with the pooled tail off, sol_attn's
    # output is exact attention over the blocks it routes, which the engine's routing must reproduce.
    q, k, v = _local((3, 20, 21), 2, seed=5)
    t, n = q.shape[1], math.ceil(q.shape[1] / 64)
    for knob, args in ((Knob("threshold", 1.3), {"tau": 1.3}), (Knob("threshold", 0.25), {"tau": 0.25}),
                       (Knob("topk", 0.2), {"topk_ratio": 0.2})):
        for sinks in (None, [0, 3], [n - 3, n]):
            blocks = sol.routed_blocks(sol._block_means(q), sol._block_means(k), 128 ** -0.5, knob, sinks)
            keep = blocks.repeat_interleave(64, -1).repeat_interleave(64, -2)[..., :t, :t]
            untailed = comfy_kitchen.sol_attn(q, k, v, tail=False, sink_blocks=sinks, sink_q=sinks, **args)
            diff = _rel_l2(untailed, _exact(q, k, v, keep=keep))
            assert diff < 1e-5, f"{knob}, sinks {sinks}: the engine's routing is not the package's ({diff:.1e})"
            share = float(sol.routed_share(q, k, 128 ** -0.5, knob, sinks))
            print(f"routing {knob} sinks {sinks}: {share:.3f} of {n}x{n} blocks, as the package routes (diff {diff:.1e})")

    # The algorithm's error against float64 attention (the compiled kernels add their INT8 rounding).
    print("relative L2 error of Sol-Attn (eager reference, fp32) against float64 attention, T=4096, 4 heads:")
    local = _local((4, 32, 32), 4, seed=11)
    g = torch.Generator().manual_seed(12)
    diffuse = tuple(torch.randn(1, 4096, 4, 128, generator=g) for _ in range(3))
    errors = {}
    for label, (q, k, v) in (("local", local), ("random", diffuse)):
        ref = _exact(q, k, v)
        for knob in (Knob("threshold", 0.5), Knob("threshold", 1.0), Knob("threshold", 1.3), Knob("threshold", 2.0),
                     Knob("topk", 0.1), Knob("topk", 0.2), Knob("topk", 0.4)):
            result = backend.run_sparse(q, k, v, None, knob)
            errors[label, knob] = err = _rel_l2(result.out, ref)
            print(f"  {label:6} {knob}: {err:.3f}, {result.share():.2f} of key blocks exact")
    default = Knob("threshold", sol.DEFAULT_TAU)
    assert errors["local", default] < errors["random", default] / 3, errors
    assert errors["random", default] > 0.5, "random q and k have no local attention to route to"
