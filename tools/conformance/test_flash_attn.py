"""flash-attn (FA2) and FA3: each release's real Python layer, called the way the engine calls it.

The compiled modules are stand-ins written from each release's C++ argument lists (standins.py). A
case fails when the engine's call does not go through a release's Python (a wrong argument, a
tensor the C++ refuses), when it unpacks a release's result wrongly, or when the result is off.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

from . import isolate, standins
from .sources import fetch

#: FA2 releases and the line of their compiled interface.
FA2_RELEASES = {"2.6.3": "2.6", "2.7.4.post1": "2.7", "2.8.3": "2.7"}
#: FA3 (hopper/ of the same sdists): release -> (line, the distribution its wheel installs as).
FA3_RELEASES = {"2.6.3": ("2.6", "flashattn-hopper"), "2.7.4.post1": ("2.7", "flash_attn"),
                "2.8.3": ("2.8", "flash_attn_3")}
HERE = "tools.conformance.test_flash_attn"


@pytest.mark.parametrize("release", FA2_RELEASES)
def test_fa2_release(release):
    print(isolate.run(f"{HERE}:fa2_case", release, str(fetch("flash-attn", release))))


@pytest.mark.parametrize("release", FA3_RELEASES)
def test_fa3_release(release):
    print(isolate.run(f"{HERE}:fa3_case", release, str(fetch("flash-attn", release))))


@pytest.mark.parametrize("release", ["2.6.3"])
def test_fa3_26_alone_refuses_other_head_sizes(release):
    print(isolate.run(f"{HERE}:fa3_alone_case", release, str(fetch("flash-attn", release))))


# --- the cases, each in its own interpreter -------------------------------------------------------

def _load_fa2(release: str, root: str):
    standins.install({"flash_attn_2_cuda": standins.flash_attn_2_cuda(FA2_RELEASES[release])})
    sys.path.insert(0, root)
    import flash_attn
    import flash_attn.flash_attn_interface as interface

    assert pathlib.Path(interface.__file__).is_relative_to(root), interface.__file__
    assert flash_attn.__version__ == release, (flash_attn.__version__, release)
    standins.allow_cpu_custom_ops(interface)
    return flash_attn


def _installed_as(dist: str, version: str, module: str, where: pathlib.Path) -> None:
    """The metadata a wheel of ``dist`` leaves beside its module, so the engine can read the version."""
    info = where / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")
    sys.path.insert(0, str(where))


def _load_fa3(release: str, root: str, tmp: pathlib.Path):
    line, dist = FA3_RELEASES[release]
    standins.install(standins.fa3_modules(line))
    _installed_as(dist, release, "flash_attn_interface", tmp)
    sys.path.insert(0, str(pathlib.Path(root) / "hopper"))
    import flash_attn_interface

    assert pathlib.Path(flash_attn_interface.__file__).is_relative_to(root)
    return flash_attn_interface


#: (name, sizes, dtype, mask rows kept or None, layout, scale): the calls SD models make.
CALLS = [
    ("SD1.5 cross-attention", dict(b=2, h=8, n=64, kv=77, d=40), "float16", None, "bhsd", None),
    ("SD1.5 self-attention", dict(b=2, h=8, n=96, kv=96, d=80), "float16", None, "bhsd", None),
    ("SD1.5 top level, bf16", dict(b=1, h=8, n=64, kv=64, d=160), "bfloat16", None, "bhsd", None),
    ("SDXL, ComfyUI layout", dict(b=2, h=10, n=64, kv=77, d=64), "float16", None, "bshd", None),
    ("SDXL, scale given", dict(b=2, h=10, n=48, kv=48, d=64), "bfloat16", None, "bhsd", 0.07),
    ("head size off the 8 grid", dict(b=1, h=4, n=33, kv=50, d=20), "float16", None, "bhsd", None),
    ("key-padding mask", dict(b=3, h=4, n=40, kv=77, d=64), "float16", [77, 30, 1], "bhsd", None),
]


def _run_calls(expect_variant, sm=90, calls=CALLS):
    import torch

    from . import engine

    for name, sizes, dtype, keep, layout, scale in calls:
        dtype = getattr(torch, dtype)
        q, k, v = engine.inputs(**sizes, dtype=dtype, layout=layout, seed=len(name))
        mask = None if keep is None else engine.key_padding(sizes["b"], sizes["kv"], keep)
        before = [t.clone() for t in (q, k, v)]
        dec = engine.decision("flash-attn", q, k, v, mask, sm=sm, layout=layout)
        want = expect_variant(sizes["d"], mask)
        assert (dec.backend, dec.variant) == ("flash-attn", want), f"{name}: {dec.backend} {dec.variant}, want {want}"
        out = dec.run(q, k, v, mask, scale)
        err = engine.check(out, q, k, v, mask, scale, layout, what=name)
        assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), f"{name}: the call wrote to q, k or v"
        print(f"{name}: {dec.variant} {dtype} rel.err {err:.2e}")


def fa2_case(release: str, root: str) -> None:
    sys.modules["flash_attn_interface"] = None  # no FA3: every call is FA2's
    _load_fa2(release, root)
    from lib_attn import kernels

    _run_calls(lambda d, mask: "FA2", sm=86)
    assert kernels.status("flash-attn").version == release


def fa3_case(release: str, root: str) -> None:
    import tempfile

    import torch

    from lib_attn import kernels

    from . import engine

    _load_fa2(release, root)
    fa3 = _load_fa3(release, root, pathlib.Path(tempfile.mkdtemp()))
    fixed = (64, 128, 256) if release.startswith("2.6.") else None

    def variant(d, mask):
        if mask is not None or d % 8 or (fixed and d not in fixed):
            return "FA2"
        return "FA3"

    _run_calls(variant, sm=90)
    assert kernels.status("flash-attn").version == f"{release} + FA3 {release}", kernels.status("flash-attn").version

    # The release's return convention is what the engine unpacks: a handler that takes the result
    # as it comes (or always its first element) fails this very check on one release line or another.
    q, k, v = engine.inputs(b=2, h=4, n=32, kv=77, d=64, dtype=torch.float16, layout="bshd")
    raw = fa3.flash_attn_func(q, k, v, softmax_scale=0.125)
    as_is, first = raw, raw[0]
    for wrong, label in ((as_is, "result as returned"), (first, "first element")):
        if isinstance(wrong, torch.Tensor) and wrong.shape == q.shape:
            continue  # this release's convention makes that handling right
        try:
            engine.check(wrong, q, k, v, None, 0.125, "bshd", what=label)
        except AssertionError as exc:
            print(f"{label}: rejected as it must be ({str(exc).splitlines()[0]})")
        else:
            raise AssertionError(f"{label} passed the check although it is not the output")


def fa3_alone_case(release: str, root: str) -> None:
    """FA3 2.6.x without FA2: SD1.5's head sizes are refused with the reason, 64 is taken."""
    import tempfile

    import torch

    from . import engine

    sys.modules["flash_attn"] = None
    _load_fa3(release, root, pathlib.Path(tempfile.mkdtemp()))
    q, k, v = engine.inputs(d=40, dtype=torch.float16)
    spec_error = ""
    try:
        engine.decision("flash-attn", q, k, v, sm=90)
    except ValueError as exc:
        spec_error = str(exc)
    assert "head_dim 40 not 64/128/256 (FA3 2.6.3" in spec_error, spec_error
    print(f"d=40 refused: {spec_error}")
    q, k, v = engine.inputs(d=64, dtype=torch.float16)
    dec = engine.decision("flash-attn", q, k, v, sm=90)
    assert dec.variant == "FA3"
    engine.check(dec.run(q, k, v, None, None), q, k, v, what="FA3 2.6.3 alone, d=64")
