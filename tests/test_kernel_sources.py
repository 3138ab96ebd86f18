"""Where flash-attn's kernels come from (FA2, FA3 under each of its distribution names, the kernel
hub's local cache) and FlashAttention-4's limits: decisions and probes, no kernel runs."""
from __future__ import annotations

import socket
import sys
import types

import pytest
import torch

import lib_attn
from lib_attn import kernels as registry
from lib_attn.device import DeviceInfo
from lib_attn.kernels import hub
from lib_attn.kernels.flash import fa3_version
from lib_attn.spec import CallSpec

AMPERE = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))
HOPPER = DeviceInfo("cuda", 0, "H200", (9, 0))
B200 = DeviceInfo("cuda", 0, "B200", (10, 0))
RTX5090 = DeviceInfo("cuda", 0, "RTX 5090", (12, 0))


def spec(device=HOPPER, dtype=torch.float16, d=64, mask="none", mask_dtype=None):
    return CallSpec(device, dtype, 2, 8, 4096, 77, d, mask=mask, mask_dtype=mask_dtype)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    hub.forget()
    lib_attn.reset()
    yield
    hub.forget()
    lib_attn.reset()


def dist_info(where, dist, version, module):
    """What a wheel of ``dist`` leaves in site-packages beside ``module``."""
    info = where / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")


# --- FA3 under each distribution name ------------------------------------------------------------

@pytest.mark.parametrize("dist,version", [("flashattn-hopper", "2.6.3"), ("flash_attn", "2.7.4.post1"),
                                          ("flash_attn_3", "2.8.3")])
def test_fa3_version_comes_from_the_distribution_holding_it(tmp_path, monkeypatch, dist, version):
    dist_info(tmp_path, dist, version, "flash_attn_interface")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fa3_version(types.ModuleType("flash_attn_interface")) == version


def test_fa3_version_is_blank_when_no_distribution_says(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p] + [str(tmp_path)])
    assert fa3_version(types.ModuleType("flash_attn_interface")) == ""


def fa_with(monkeypatch, fa2=True, fa3_version_text="2.8.3"):
    fa = registry.REGISTRY["flash-attn"]
    monkeypatch.setattr(fa, "fa2", object() if fa2 else None)
    monkeypatch.setattr(fa, "fa3", object())
    monkeypatch.setattr(fa, "fa3_version", fa3_version_text)
    return fa


@pytest.mark.parametrize("d,want", [(40, "FA2"), (80, "FA2"), (160, "FA2"), (64, "FA3"), (128, "FA3"), (256, "FA3")])
def test_fa3_26_takes_its_three_head_sizes_and_fa2_the_rest(monkeypatch, d, want):
    fa = fa_with(monkeypatch, fa3_version_text="2.6.3")
    assert fa.variant(spec(d=d)) == want
    assert fa.reasons(spec(d=d)) == []  # the backend is never demoted for a head size FA2 takes


@pytest.mark.parametrize("d", [40, 80, 160, 64])
def test_later_fa3_takes_every_multiple_of_8(monkeypatch, d):
    assert fa_with(monkeypatch, fa3_version_text="2.7.4.post1").variant(spec(d=d)) == "FA3"


def test_fa3_26_alone_refuses_other_head_sizes_naming_them(monkeypatch):
    fa = fa_with(monkeypatch, fa2=False, fa3_version_text="2.6.3")
    assert fa.reasons(spec(d=40)) == ["head_dim 40 not 64/128/256 (FA3 2.6.3; FA2 is not installed)"]
    assert fa.reasons(spec(d=64)) == []


def test_fa3_26_is_handed_contiguous_inputs(monkeypatch):
    fa = fa_with(monkeypatch, fa3_version_text="2.6.3")
    seen = []

    def flash_attn_func(q, k, v, softmax_scale=None):
        seen.append(all(t.is_contiguous() for t in (q, k, v)))
        return q.clone(), None

    monkeypatch.setattr(fa, "fa3", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    q = torch.randn(2, 8, 16, 64).transpose(1, 2)  # a bhsd tensor seen as bshd: not contiguous
    out = fa.runner(spec(d=64))(q, q, q, None, None)
    assert seen == [True] and torch.equal(out, q)
    monkeypatch.setattr(fa, "fa3_version", "2.8.3")
    fa.runner(spec(d=64))(q, q, q, None, None)
    assert seen == [True, False]  # later releases take any tensor with a unit last stride


# --- the kernel hub's local cache ----------------------------------------------------------------

def hub_build(root, kind, folder=None, body="def flash_attn_func(q, k, v, **kw):\n    return q\n"):
    org, name = hub.REPOS[kind].split("/")
    build = root / f"kernels--{org}--{name}" / "snapshots" / "0123456789abcdef" / "build" / (
        folder or hub.build_name().replace("-*-", "-cxx11-"))
    package = build / name.replace("-", "_")
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from ._ops import NAME\n" + body)
    (package / "_ops.py").write_text(f"NAME = {name!r}\n")
    return build


@pytest.fixture
def kernels_installed(tmp_path, monkeypatch):
    """The ``kernels`` package is importable, and the hub cache is a folder of the test's."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    return cache


@pytest.fixture
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the hub lookup opened a network connection")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_hub_without_the_kernels_package_says_so(monkeypatch, offline):
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name, *a: None)
    module, why = hub.load("flash-attn3")
    assert module is None and why == "the kernels package is not installed (pip install kernels)"


def test_hub_build_not_in_the_cache_names_what_fetches_it(kernels_installed, offline):
    hub_build(kernels_installed, "flash-attn3", folder="torch27-cxx11-cu126-x86_64-linux")  # another torch's
    module, why = hub.load("flash-attn3")
    assert module is None
    assert "no build of kernels-community/flash-attn3 for torch" in why
    assert "ATTN_INSTALL=hub-flash-attn3" in why and "nothing is downloaded" in why


def test_hub_loads_the_cached_build_for_this_torch_once(kernels_installed, offline):
    build = hub_build(kernels_installed, "flash-attn3")
    module, why = hub.load("flash-attn3")
    assert why == "" and module.NAME == "flash-attn3"
    assert module.hub_source.endswith(build.name) and module.hub_source.startswith("kernels-community/flash-attn3")
    assert hub.load("flash-attn3")[0] is module


def test_hub_build_that_fails_to_import_gives_its_error(kernels_installed, offline):
    hub_build(kernels_installed, "flash-attn2", body="raise ImportError('undefined symbol: _ZN3c10')\n")
    module, why = hub.load("flash-attn2")
    assert module is None and "does not load: ImportError: undefined symbol" in why


def test_hub_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown hub kernel 'fa9' \\(known: flash-attn2, flash-attn3, sage\\)"):
        hub.load("fa9")


def test_flash_attn_probe_takes_fa2_from_the_hub_when_the_package_is_missing(kernels_installed, offline, monkeypatch):
    hub_build(kernels_installed, "flash-attn2",
              body="def flash_attn_func(*a, **k):\n    pass\ndef flash_attn_varlen_func(*a, **k):\n    pass\n")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    fa = registry.REGISTRY["flash-attn"]
    found = fa._probe()
    assert found.available and found.version.startswith("hub kernels-community/flash-attn2")
    assert fa.fa2.NAME == "flash-attn2" and fa.fa3 is None


def test_flash_attn_probe_reason_carries_the_hub_line(kernels_installed, offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    found = registry.REGISTRY["flash-attn"]._probe()
    assert not found.available
    assert "hub: no build of kernels-community/flash-attn2" in found.reason


# --- FlashAttention-4 ----------------------------------------------------------------------------

def fa4_reasons(call):
    return registry.REGISTRY["flash-attn-4"].reasons(call)


def test_fa4_reasons_follow_the_package():
    assert fa4_reasons(spec(d=40)) == []
    assert fa4_reasons(spec(d=160)) == []  # sm90 takes 8-256
    assert fa4_reasons(spec(device=B200, d=160)) == ["head_dim 160 not in 8-128 or 256 (FA4 on sm100)"]
    assert fa4_reasons(spec(device=B200, d=256)) == []
    assert fa4_reasons(spec(device=RTX5090, d=80)) == []
    assert fa4_reasons(spec(device=RTX5090, d=160)) == ["head_dim 160 not in 8-128 (FA4 on sm120)"]
    assert fa4_reasons(spec(d=36)) == ["head_dim 36 not a multiple of 8 (FA4)"]
    assert any(r.startswith("GPU sm86: FA4 targets Hopper") for r in fa4_reasons(spec(device=AMPERE)))
    assert "dtype float32 not supported (fp16/bf16)" in fa4_reasons(spec(dtype=torch.float32))
    assert "key-padding attention mask not supported" in fa4_reasons(spec(mask="key-padding", mask_dtype=torch.bool))
    mi300 = DeviceInfo("cuda", 0, "MI300X", (9, 4), platform="rocm", arch="gfx942")
    assert fa4_reasons(spec(device=mi300)) == ["gfx942: FA4 has no ROCm build (CuTe DSL, NVIDIA only)"]


def test_fa4_probe_reads_the_pypi_distribution_version(tmp_path, monkeypatch):
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = lambda *a, **k: None
    cute.__version__ = "0.0.0"  # what its own lookup of a distribution named "fa4" gives
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    dist_info(tmp_path, "flash-attn-4", "4.0.0b40", "flash_attn")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.REGISTRY["flash-attn-4"]._probe().version == "4.0.0b40"


def test_fa4_unpacks_out_and_lse():
    fa4 = registry.REGISTRY["flash-attn-4"]
    calls = []
    fa4.func = lambda q, k, v, **kw: calls.append(kw) or (q + 1, None)
    try:
        q = torch.zeros(1, 2, 1, 8)
        assert torch.equal(fa4.run(q, q, q, None, 0.5), q + 1)
        assert calls == [{"softmax_scale": 0.5, "causal": False}]
    finally:
        fa4.func = None


def test_fa4_is_never_in_a_default_chain():
    for device in (AMPERE, HOPPER, B200, RTX5090):
        for role in ("unet", "vae"):
            assert "flash-attn-4" not in lib_attn.default_chain(role, device, fa3=True, cudnn=91600)


# --- the new ids everywhere ids are taken ----------------------------------------------------------

def test_fa4_id_is_taken_where_ids_are_and_a_bad_id_names_it():
    from types import SimpleNamespace

    from lib_attn.config import normalise_preference
    from webui_attn.settings import flags

    assert "flash-attn-4" in lib_attn.BACKEND_IDS
    assert normalise_preference(["flash-attn-4", "sdpa"])["unet"] == ("flash-attn-4", "sdpa")
    assert flags.parse_ids("flash-attn-4,sdpa") == (["flash-attn-4", "sdpa"], [])
    with pytest.raises(ValueError) as err:
        normalise_preference(["flash-attn-5"])
    assert "'flash-attn-5'" in str(err.value) and "flash-attn-4" in str(err.value)
    bad = flags.problems(SimpleNamespace(attn_backend="flash-attn-5"))
    assert bad and "flash-attn-5" in bad[0] and "flash-attn-4" in bad[0]


def test_a_new_probe_looks_at_the_hub_cache_again(kernels_installed, offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    assert not registry.status("flash-attn").available
    hub_build(kernels_installed, "flash-attn2",
              body="def flash_attn_func(*a, **k):\n    pass\ndef flash_attn_varlen_func(*a, **k):\n    pass\n")
    registry.reset_probes()  # what a run-time install is followed by
    assert registry.REGISTRY["flash-attn"]._probe().version.startswith("hub kernels-community/flash-attn2")
