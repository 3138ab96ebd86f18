"""SageAttention 1/2/3 as the engine sees each release: what it refuses and why, what it reads from the
installed package, and that the caller's tensors and CUDA device are left as they were.

The kernels themselves need a GPU; their real Python runs on CPU in ``tools/conformance``. Here the
stand-in kernels do what the packages' Python does to their inputs (1.x and 3 subtract the key mean
from the ``k`` they get, in place) and compute exact attention.
"""
from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

import lib_attn
from lib_attn.device import DeviceInfo
from lib_attn.chains import default_chain
from lib_attn.decision import decide
from lib_attn.kernels import REGISTRY, Status, sage as sage_module, sage_facts
from lib_attn.kernels.base import release
from lib_attn.spec import CallSpec

from engine_helpers import install_sage, make_qkv, reference, rel_err, sage_release

AMPERE_86 = DeviceInfo("cuda", 0, "RTX 3090", (8, 6))
A100 = DeviceInfo("cuda", 0, "A100", (8, 0))
ADA = DeviceInfo("cuda", 0, "RTX 4090", (8, 9))
HOPPER = DeviceInfo("cuda", 0, "H200", (9, 0))
RTX_5090 = DeviceInfo("cuda", 0, "RTX 5090", (12, 0))
TURING = DeviceInfo("cuda", 0, "RTX 2080", (7, 5))
ALL_INSTALLED = {bid: Status(True, version="test") for bid in lib_attn.BACKEND_IDS}


def spec(device=AMPERE_86, kv=77, d=64, q=4096, dtype=torch.float16, mask="none", mask_dtype=None):
    return CallSpec(device, dtype, 2, 10, q, kv, d, mask=mask, mask_dtype=mask_dtype)


def reasons(bid, call, asked=False):
    return REGISTRY[bid].reasons(call, asked=asked)


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


# --- what each release is refused --------------------------------------------------------------

def test_sage_1_0_6_refuses_every_call_whose_keys_are_not_a_multiple_of_64(monkeypatch):
    install_sage(monkeypatch, sage_release("1.0.6"))
    expected = "kv_len 77 not a multiple of 64: SageAttention 1.0.6 miscomputes it (fixed in 2.2.0)"
    for bid in ("sage", "sage-triton"):
        assert reasons(bid, spec(kv=77)) == [expected]
        assert reasons(bid, spec(kv=77, device=HOPPER)) == [expected]
        assert any("kv_len 100 not a multiple of 64" in r for r in reasons(bid, spec(kv=100)))
        for kv in (64, 128, 1024, 4096):
            assert reasons(bid, spec(kv=kv)) == [], kv


def test_sage_2_0_1_refuses_such_calls_only_where_sageattn_runs_its_triton_kernel(monkeypatch):
    install_sage(monkeypatch, sage_release("2.0.1"))
    fault = "kv_len 77 not a multiple of 64: SageAttention 2.0.1's Triton kernel miscomputes it (fixed in 2.2.0)"
    assert reasons("sage", spec(device=AMPERE_86)) == [fault]  # sm86: the Triton kernel
    assert reasons("sage", spec(device=A100)) == []             # sm80: the fp16 CUDA kernel
    assert reasons("sage", spec(device=ADA)) == []              # sm89: the fp8 CUDA kernel
    assert reasons("sage-triton", spec(device=A100)) == [fault]
    assert reasons("sage-cuda", spec(device=AMPERE_86)) == []
    assert reasons("sage", spec(device=AMPERE_86, kv=4096)) == []
    assert any("sm120 has no SageAttention 2.0.1 kernel" in r for r in reasons("sage", spec(device=RTX_5090)))


def test_sage_2_2_0_takes_them(monkeypatch):
    install_sage(monkeypatch, sage_release("2.2.0"))
    for device in (A100, AMPERE_86, ADA, HOPPER, RTX_5090):
        assert reasons("sage", spec(device=device, kv=77)) == [], device


def test_a_2_2_0_built_before_the_fix_is_refused_as_2_0_1_is(monkeypatch):
    install_sage(monkeypatch, sage_release("2.2.0", triton_pads_right=False, triton_masks=False))
    assert any("kv_len 77 not a multiple of 64" in r for r in reasons("sage-triton", spec()))


def test_pinned_kernels_state_their_gpus_and_builds(monkeypatch):
    install_sage(monkeypatch, sage_release("2.2.0"))
    assert reasons("sage-fp8", spec(device=ADA)) == []
    assert reasons("sage-fp8", spec(device=HOPPER)) == []  # the sm90 kernel
    assert reasons("sage-fp8", spec(device=A100)) == [
        "GPU sm80: SageAttention 2.2.0's fp8 CUDA kernels run on sm89, sm90, sm120, sm121 only"]
    assert reasons("sage-fp8pp", spec(device=HOPPER)) == [
        "GPU sm90: SageAttention 2.2.0's fp8 CUDA kernels run on sm89, sm120, sm121 only"]
    assert reasons("sage-fp8", spec(device=HOPPER)) == reasons("sage-fp8", spec(device=HOPPER), asked=True) == []
    install_sage(monkeypatch, sage_release("2.0.1"))  # no sm90 fp8 kernel before 2.1
    assert any("run on sm89, sm120, sm121 only" in r for r in reasons("sage-fp8", spec(device=HOPPER)))
    install_sage(monkeypatch, sage_release("2.2.0"))
    assert reasons("sage-cuda", spec(device=TURING)) == ["GPU sm75 < sm80 (SageAttention 2.2.0)"]
    # sageattn itself never uses the Triton kernel on consumer Blackwell; named, it runs there.
    assert any("does not use its Triton kernel" in r for r in reasons("sage-triton", spec(device=RTX_5090)))
    assert reasons("sage-triton", spec(device=RTX_5090), asked=True) == []
    install_sage(monkeypatch, sage_release("2.2.0", compiled=frozenset({"cuda"})))
    assert reasons("sage-fp8", spec(device=ADA)) == [
        "SageAttention 2.2.0 is installed without its sm89 (fp8 CUDA) kernels"]
    assert reasons("sage", spec(device=ADA)) == reasons("sage-fp8", spec(device=ADA))


def test_masks_reach_only_the_triton_kernel_of_a_release_that_applies_them(monkeypatch):
    padded = dict(mask="key-padding", mask_dtype=torch.bool)
    install_sage(monkeypatch, sage_release("2.2.0"))
    assert reasons("sage-triton", spec(**padded)) == []
    assert reasons("sage-triton", spec(mask="dense", mask_dtype=torch.float16)) == []
    assert "key-padding attention mask not supported" in reasons("sage", spec(**padded))  # sageattn drops it
    install_sage(monkeypatch, sage_release("2.0.1"))
    assert any("Triton kernel takes none" in r for r in reasons("sage-triton", spec(device=A100, kv=128, **padded)))


def test_the_pinned_kernels_are_unavailable_on_sage_1_and_say_so():
    facts = sage_release("1.0.6")
    for bid in ("sage-cuda", "sage-fp8", "sage-fp8pp"):
        found = REGISTRY[bid].facts_status(facts)
        assert not found.available and "has only its Triton kernel" in found.reason
    assert REGISTRY["sage-triton"].facts_status(facts).available
    old = REGISTRY["sage-fp8pp"].facts_status(sage_release("2.0.1"))
    assert not old.available and "fp32+fp16" in old.reason


def test_a_refused_call_runs_on_the_next_kernel_and_the_fallback_names_the_reason(monkeypatch):
    install_sage(monkeypatch, sage_release("1.0.6"))
    chain = ("sage",) + default_chain("unet", AMPERE_86)
    cross = decide(spec(kv=77), chain, ALL_INSTALLED, explicit=True)
    assert cross.backend != "sage" and cross.backend in chain
    assert cross.fallback_key == ("unet", "sage",
                                  "kv_len 77 not a multiple of 64: SageAttention 1.0.6 miscomputes it (fixed in 2.2.0)")
    assert decide(spec(kv=4096), chain, ALL_INSTALLED, explicit=True).backend == "sage"


def test_the_variant_says_which_kernel_sageattn_runs(monkeypatch):
    install_sage(monkeypatch, sage_release("2.2.0"))
    assert REGISTRY["sage"].variant(spec(device=ADA)) == "fp8 CUDA"
    assert REGISTRY["sage"].variant(spec(device=HOPPER)) == "fp8 CUDA sm90"
    assert REGISTRY["sage"].variant(spec(device=AMPERE_86)) == "Triton"


# --- facts read from the installed package ------------------------------------------------------

DISPATCH_2_0 = '''
def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **kwargs):
    arch = get_cuda_arch_versions()[q.device.index]
    if arch == "sm80":
        return sageattn_qk_int8_pv_fp16_cuda(q, k, v, pv_accum_dtype="fp32")
    elif arch == "sm86":
        return sageattn_qk_int8_pv_fp16_triton(q, k, v)
    elif arch == "sm89":
        return sageattn_qk_int8_pv_fp8_cuda(q, k, v, pv_accum_dtype="fp32+fp32")
    elif arch == "sm90":
        return sageattn_qk_int8_pv_fp16_cuda(q, k, v, pv_accum_dtype="fp32")
    else:
        raise ValueError(f"Unsupported CUDA architecture: {arch}")
'''
DISPATCH_LATER = DISPATCH_2_0.replace('''    elif arch == "sm90":
        return sageattn_qk_int8_pv_fp16_cuda(q, k, v, pv_accum_dtype="fp32")''', '''    elif arch == "sm90":
        return sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, pv_accum_dtype="fp32+fp32")
    elif arch == "sm120":
        return sageattn_qk_int8_pv_fp8_cuda(q, k, v, qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp16")
    elif arch == "sm121":
        return sageattn_qk_int8_pv_fp8_cuda(q, k, v, qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp16")''')
KERNELS = '''
SM80_ENABLED = True
SM89_ENABLED = {sm89}
SM90_ENABLED = True

def sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="HND", quantization_backend="triton", is_causal=False,
                                    {mask}sm_scale=None, smooth_k=True, return_lse=False, **kwargs):
    pass

def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread",
                                  sm_scale=None, pv_accum_dtype="fp32", **kwargs):
    pass

def sageattn_qk_int8_pv_fp8_cuda(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread",
                                 sm_scale=None, pv_accum_dtype="{fp8_default}", **kwargs):
    if pv_accum_dtype == "fp32+fp32":
        pass
'''
#: The Triton kernel's inner loop before and after the fix, reduced to the lines that differ.
TRITON_BEFORE = "k = tl.load(K_ptrs, mask=k_mask)\nqk = tl.dot(q, k)\n"
TRITON_AFTER = TRITON_BEFORE + "qk += tl.where(k_mask, 0, -1.0e6)\n"


def write_sage(root, *, dispatch=DISPATCH_LATER, triton=TRITON_AFTER, mask=True, sm89=True, fp8_default="fp32+fp16",
               sm90_kernel=True, version=None):
    """A sageattention 2.x package laid out as the release is (core.py, triton/attn_qk_int8_per_block.py)."""
    package = root / "sageattention"
    (package / "triton").mkdir(parents=True)
    kernels = KERNELS.format(mask="attn_mask=None, " if mask else "", sm89=sm89, fp8_default=fp8_default)
    if sm90_kernel:
        kernels += "\ndef sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, **kwargs):\n    pass\n"
    (package / "core.py").write_text(dispatch + kernels)
    names = ["sageattn"] + [n for n in sage_facts.FUNCTIONS.values() if sm90_kernel or not n.endswith("sm90")]
    init = f"from .core import {', '.join(names)}\n"
    if version:
        init += f"__version__ = {version!r}\n"
    (package / "__init__.py").write_text(init)
    (package / "triton" / "__init__.py").write_text("")
    (package / "triton" / "attn_qk_int8_per_block.py").write_text(triton)


@pytest.fixture
def fresh_imports(monkeypatch):
    """Packages written by a test are imported from its tmp_path and gone from sys.modules after it."""
    names = ("sageattention", "sageattn")

    def ours(name):
        return any(name == n or name.startswith(n + ".") for n in names)

    for name in [m for m in sys.modules if ours(m)]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if ours(m)]:
        del sys.modules[name]


def read_written(monkeypatch, root):
    monkeypatch.syspath_prepend(str(root))
    return sage_facts.load()


def test_facts_of_a_release_after_2_2_0(tmp_path, monkeypatch, fresh_imports):
    write_sage(tmp_path, version="2.2.0")
    facts = read_written(monkeypatch, tmp_path)
    assert facts.version == "2.2.0" and facts.major == 2
    assert facts.dispatch == {80: "cuda", 86: "triton", 89: "fp8", 90: "fp8-sm90", 120: "fp8", 121: "fp8"}
    assert facts.triton_pads_right and facts.triton_masks and facts.fp8_fp16_accum
    assert facts.compiled == {"cuda", "fp8", "fp8-sm90"}


def test_facts_of_2_0_1(tmp_path, monkeypatch, fresh_imports):
    write_sage(tmp_path, dispatch=DISPATCH_2_0, triton=TRITON_BEFORE, mask=False, fp8_default="fp32+fp32",
               sm90_kernel=False, version="2.0.1")
    facts = read_written(monkeypatch, tmp_path)
    assert facts.dispatch == {80: "cuda", 86: "triton", 89: "fp8", 90: "cuda"}
    assert not facts.triton_pads_right and not facts.triton_masks and not facts.fp8_fp16_accum
    assert facts.padding_fault("triton", 77) and facts.padding_fault("cuda", 77) is None


def test_a_2_2_0_whose_triton_kernel_predates_the_fix_is_read_as_faulty(tmp_path, monkeypatch, fresh_imports):
    write_sage(tmp_path, triton=TRITON_BEFORE, version="2.2.0")
    facts = read_written(monkeypatch, tmp_path)
    assert not facts.triton_pads_right and not facts.triton_masks


def test_a_build_without_its_sm89_kernels_says_so(tmp_path, monkeypatch, fresh_imports):
    write_sage(tmp_path, sm89=False, version="2.2.0")
    facts = read_written(monkeypatch, tmp_path)
    assert facts.compiled == {"cuda", "fp8-sm90"}


def test_sage_1_without_metadata_is_told_by_its_exports(tmp_path, monkeypatch, fresh_imports):
    (tmp_path / "sageattention").mkdir()
    (tmp_path / "sageattention" / "__init__.py").write_text("def sageattn(q, k, v, **kwargs):\n    pass\n")
    facts = read_written(monkeypatch, tmp_path)
    assert facts.major == 1 and facts.functions == {"triton": facts.sageattn}


@pytest.mark.parametrize("text, expected", [("1.0.6", (1, 0, 6)), ("2.2.0.post2+cu128torch2.8.0", (2, 2, 0)),
                                            ("2.1", (2, 1, 0)), ("", (0, 0, 0))])
def test_release_numbers(text, expected):
    assert release(text) == expected


# --- what a call does to the caller --------------------------------------------------------------

def exact(q, k, v, scale):
    return reference(q, k, v, scale=scale).to(q.dtype)


def sageattn_1(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kwargs):
    """SageAttention 1.0.6's Python: with ``smooth_k`` it subtracts the key mean from ``k`` in place."""
    if smooth_k:
        k -= k.mean(dim=2, keepdim=True)
    return exact(q, k, v, sm_scale)


def test_sage_1_never_writes_the_callers_keys(monkeypatch):
    facts = sage_facts.SageFacts("1.0.6", 1, sageattn_1, {"triton": sageattn_1})
    install_sage(monkeypatch, facts)
    for bid in ("sage", "sage-triton"):
        q, k, v = make_qkv(2, 4, 96, 128, 64, torch.float32)
        kept = k.clone()
        out = REGISTRY[bid].runner(spec(kv=128))(q, k, v, None, 0.2)
        assert torch.equal(k, kept), bid
        assert rel_err(out, reference(q, kept, v, scale=0.2)) < 1e-5


def test_sage_2_keeps_the_callers_current_device(monkeypatch):
    """2.x calls torch.cuda.set_device(v.device) on every call; a call on cuda:1 from a thread whose
    current device is cuda:0 leaves cuda:0 current."""
    current = {"index": 0}

    class Guard:
        def __init__(self, device):
            self.index = device.index

        def __enter__(self):
            self.before, current["index"] = current["index"], self.index

        def __exit__(self, *exc):
            current["index"] = self.before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "device", Guard)

    class OnCuda1:
        device = torch.device("cuda", 1)

    def kernel(q, k, v, **kwargs):
        current["index"] = q.device.index  # what the package's set_device does
        return "out"

    assert sage_module._on_device(kernel, OnCuda1(), None, None) == "out"
    assert current["index"] == 0


def test_the_triton_kernel_gets_the_mask_as_it_takes_it(monkeypatch):
    seen = {}

    def triton(q, k, v, tensor_layout="HND", is_causal=False, attn_mask=None, sm_scale=None, **kwargs):
        seen["mask"] = attn_mask
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(
            ~attn_mask, float("-inf"))
        return reference(q, k, v, bias, scale=sm_scale).to(q.dtype)

    install_sage(monkeypatch, sage_release("2.2.0", functions={"triton": triton}))
    q, k, v = make_qkv(2, 4, 96, 77, 64, torch.float16)
    keep = torch.rand(2, 77) > 0.3
    keep[:, 0] = True
    mask = keep[:, None, None, :]
    call = spec(kv=77, mask="key-padding", mask_dtype=torch.bool)
    out = REGISTRY["sage-triton"].runner(call)(q, k, v, mask, None)
    assert seen["mask"].dtype == torch.bool and seen["mask"].dim() == 4
    assert rel_err(out, reference(q, k, v, mask)) < 2e-3
    float_mask = torch.randn(2, 1, 96, 77)  # fp32: the kernel wants q's dtype
    out = REGISTRY["sage-triton"].runner(spec(kv=77, mask="dense", mask_dtype=torch.float32))(q, k, v, float_mask, None)
    assert seen["mask"].dtype == torch.float16
    assert rel_err(out, reference(q, k, v, float_mask)) < 2e-3


# --- SageAttention 3 ----------------------------------------------------------------------------

def sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True, **kwargs):
    """SageAttention 3's Python: the key mean comes off ``k`` in place, and the scale is 1/sqrt(d)."""
    k -= k.mean(dim=-2, keepdim=True)
    return exact(q, k, v, None)


def test_sage3_limits():
    sage3 = REGISTRY["sage3"]
    long = dict(q=4096, kv=4096)
    assert sage3.reasons(spec(device=RTX_5090, d=128, **long)) == []
    assert sage3.reasons(spec(device=HOPPER, d=128, **long)) == ["GPU sm90: SageAttention 3 runs on sm120/sm121 only"]
    assert sage3.reasons(spec(device=RTX_5090, d=80, **long)) == ["head_dim 80 not in 64/128 (SageAttention 3)"]
    assert sage3.reasons(spec(device=RTX_5090, d=64, q=4096, kv=77)) == [
        "kv_len 77 < 1024: SageAttention 3 (FP4) is kept to long sequences, where it pays"]
    assert sage3.reasons(spec(device=RTX_5090, d=64, q=256, kv=4096)) == [
        "q_len 256 < 1024: SageAttention 3 (FP4) is kept to long sequences, where it pays"]
    assert "mask" in " ".join(sage3.reasons(spec(device=RTX_5090, mask="key-padding", mask_dtype=torch.bool, **long)))


def test_sage3_keeps_the_callers_keys_and_honours_the_scale(monkeypatch):
    monkeypatch.setattr(REGISTRY["sage3"], "fn", sageattn3_blackwell)
    for scale in (None, 0.05):
        q, k, v = make_qkv(1, 2, 128, 128, 64, torch.float32)
        kept = k.clone()
        out = REGISTRY["sage3"].run(q, k, v, None, scale)
        assert torch.equal(k, kept)
        assert rel_err(out, reference(q, kept, v, scale=scale)) < 1e-5, scale
        assert scale is None or rel_err(out, reference(q, kept, v)) > 0.01


def test_sage3_is_found_under_both_packagings(tmp_path, monkeypatch, fresh_imports):
    (tmp_path / "sageattn").mkdir()
    (tmp_path / "sageattn" / "__init__.py").write_text(textwrap.dedent('''
        __version__ = "0.1"
        def sageattn_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True):
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(REGISTRY["sage3"], "fn", None)
    found = REGISTRY["sage3"]._probe()
    assert found.available and found.version == "0.1" and REGISTRY["sage3"].fn.__name__ == "sageattn_blackwell"


def test_every_sage_backend_is_approximate_and_out_of_the_default_chains():
    sage_ids = [bid for bid in lib_attn.BACKEND_IDS if bid.startswith("sage")]
    assert sage_ids == ["sage", "sage-triton", "sage-cuda", "sage-fp8", "sage-fp8pp", "sage3"]
    for bid in sage_ids:
        assert REGISTRY[bid].approximate and not REGISTRY[bid].backward
    for device in (A100, AMPERE_86, ADA, HOPPER, RTX_5090):
        for role in lib_attn.ROLES:
            assert not set(sage_ids) & set(default_chain(role, device, fa3=False, cudnn=91600))
    assert math.isfinite(sage_facts.KEY_BLOCK)


# --- the kernel hub's build ---------------------------------------------------------------------

from test_kernel_sources import hub_build, kernels_installed, offline  # noqa: E402,F401 - fixtures
from lib_attn.kernels import hub  # noqa: E402


def test_sage_and_sage3_from_the_kernel_hubs_cached_build(kernels_installed, offline, monkeypatch):
    """Without the sageattention package, the hub's build serves ``sage`` and ``sage3``; it exports no
    pinned kernel, and with no release number and no readable Triton kernel its fix is not assumed."""
    body = DISPATCH_LATER + textwrap.dedent('''
        def sageattn_qk_int8_pv_fp16_cuda(*a, **k): pass
        def sageattn_qk_int8_pv_fp16_triton(*a, **k): pass
        def sageattn_qk_int8_pv_fp8_cuda(*a, **k): pass
        def sageattn_qk_int8_pv_fp8_cuda_sm90(*a, **k): pass
        def per_warp_int8(*a, **k): pass
        def per_channel_fp8(*a, **k): pass
        def sageattn3_blackwell(q, k, v, attn_mask=None, is_causal=False, per_block_mean=True, **kwargs): pass
    ''').replace("def sageattn_qk", "def _sageattn_qk")  # the hub exports sageattn, not the pinned kernels
    hub_build(kernels_installed, "sage", body=body)
    monkeypatch.setitem(sys.modules, "sageattention", None)
    monkeypatch.setitem(sys.modules, "sageattn3", None)
    monkeypatch.setitem(sys.modules, "sageattn", None)
    hub.forget()
    for bid in ("sage", "sage-cuda", "sage3"):
        monkeypatch.setattr(REGISTRY[bid], "facts" if bid != "sage3" else "fn", None)
    found = REGISTRY["sage"]._probe()
    facts = REGISTRY["sage"].facts
    assert found.available and found.version.startswith("hub kernels-community/sage-attention")
    assert facts.major == 2 and facts.dispatch[89] == "fp8" and facts.functions == {}
    assert reasons("sage", spec(device=ADA)) == []
    assert reasons("sage", spec(device=AMPERE_86)) == [
        "kv_len 77 not a multiple of 64: " + facts.name + "'s Triton kernel is not shown to mask the keys past kv_len "
        "(the fix of 2.2.0)"]
    pinned = REGISTRY["sage-cuda"].facts_status(facts)
    assert not pinned.available and "has no sageattn_qk_int8_pv_fp16_cuda" in pinned.reason
    three = REGISTRY["sage3"]._probe()
    assert three.available and three.version == found.version
    hub.forget()


def test_without_package_or_hub_build_the_reason_names_both(monkeypatch, offline):
    monkeypatch.setitem(sys.modules, "sageattention", None)
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name, *a: None)
    hub.forget()
    monkeypatch.setattr(REGISTRY["sage"], "facts", None)
    found = REGISTRY["sage"].probe()
    assert not found.available and "sageattention" in found.reason
    assert found.reason.endswith("; hub: the kernels package is not installed (pip install kernels)")
    hub.forget()
