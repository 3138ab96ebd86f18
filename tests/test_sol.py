"""Sol-Attn (comfy-kitchen's ``sol_attn``) as the engine's sparse backend ``sol``: what it refuses and why,
the arguments a knob and a conditioning prefix become, its calibration ladder, the share of blocks it
reports, and how a call reaches the package.

The package's real Python (its eager reference on CPU) runs in ``tools/conformance/test_comfy_kitchen.py``,
where the engine's calls are compared with ``comfy_kitchen.sol_attn`` called directly. Here a stand-in
module has the names 0.2.40 has; its ``sol_attn`` records what it was given and checks what the
release's own rule checks (one shape and dtype, head_dim 128).
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import lib_attn
from lib_attn import conditioning
from lib_attn.config import sparse_problem
from lib_attn.device import DeviceInfo
from lib_attn.kernels import REGISTRY, SPARSE_IDS, reset_probes, sol
from lib_attn.kernels.sparse import Knob
from lib_attn.spec import CallSpec

from engine_helpers import reference, rel_err

A100 = DeviceInfo("cuda", 0, "A100", (8, 0))
TURING = DeviceInfo("cuda", 0, "RTX 2080", (7, 5))
RDNA3 = DeviceInfo("cuda", 0, "RX 7900", None, platform="rocm", arch="gfx1100")
MI300 = DeviceInfo("cuda", 0, "MI300X", None, platform="rocm", arch="gfx942")
CPU = DeviceInfo("cpu", None, "cpu", None)
SOL = REGISTRY["sol"]


def spec(device=A100, d=128, q=16384, kv=None, dtype=torch.bfloat16, b=1, h=8):
    return CallSpec(device, dtype, b, h, q, q if kv is None else kv, d, layout="bshd", role="dit")


def test_it_is_a_sparse_backend_that_no_chain_names_and_auto_tries_first():
    assert tuple(SPARSE_IDS)[0] == "sol" and SOL.approximate and SOL.block == 64 and not SOL.returns_lse
    assert SOL.knobs == ("threshold", "topk") and SOL.default_knob == Knob("threshold", 1.3)


def test_what_it_takes_on_a_gpu_and_what_it_refuses_there(monkeypatch):
    _stand_in(monkeypatch)
    sys.modules["comfy_kitchen"].sol_attn_is_available = lambda device=None: True
    SOL._probe()
    assert SOL.reasons(spec()) == [] and SOL.reasons(spec(dtype=torch.float16, device=RDNA3)) == []
    assert SOL.reasons(spec(d=64)) == ["head_dim 64 != 128 (Sol-Attn's kernels are built for 128)"]
    assert SOL.reasons(spec(kv=77)) == ["q_len 16384 != kv_len 77 (Sol-Attn takes self-attention)"]
    assert SOL.reasons(spec(TURING)) == ["GPU sm75 < sm80 (Sol-Attn's compiled kernels)"]
    assert SOL.reasons(spec(dtype=torch.float32)) == ["dtype float32 not supported (fp16/bf16)"]
    assert SOL.reasons(spec(MI300)) == ["gfx942: Sol-Attn's HIP kernels need WMMA matrix cores (RDNA3 or newer: "
                                        "gfx11xx, gfx12xx)"]


def test_on_a_cpu_its_eager_reference_runs_only_when_named_and_within_its_own_limit():
    (why,) = SOL.reasons(spec(CPU, dtype=torch.float32))
    assert why.startswith("cpu: Sol-Attn runs its eager reference here") and "only when named" in why
    assert SOL.reasons(spec(CPU, dtype=torch.float32, q=4096), asked=True) == []
    assert SOL.reasons(spec(CPU, dtype=torch.bfloat16, q=4096), asked=True) == []
    assert SOL.reasons(spec(CPU, q=32768, h=2), asked=True) == [
        "cpu: Sol-Attn's eager reference would hold 8.0 GiB of scores (its limit: 4 GiB)"]


def test_a_knob_becomes_tau_or_topk_ratio_and_the_conditioning_tokens_its_sinks_first_or_last():
    assert SOL.arguments(4096, Knob("threshold", 1.3)) == {"tau": 1.3, "sink_blocks": None, "sink_q": None}
    assert SOL.arguments(4096, Knob("topk", 0.2)) == {"topk_ratio": 0.2, "sink_blocks": None, "sink_q": None}
    with conditioning.text(512, total=4608):
        assert SOL.arguments(4608, Knob("topk", 0.2)) == {"topk_ratio": 0.2, "sink_blocks": [0, 8], "sink_q": [0, 8]}
        assert SOL.arguments(4096, Knob("topk", 0.2))["sink_blocks"] is None   # another call: not the joint one
        with conditioning.text(100, total=4096):
            assert SOL.arguments(4096, Knob("topk", 0.2))["sink_blocks"] == [0, 2]  # 100 tokens touch 2 blocks
        assert SOL.arguments(4608, Knob("topk", 0.2))["sink_blocks"] == [0, 8]     # the outer one again
    # HunyuanVideo's text after the video: the blocks from the one the text starts in to the last
    with conditioning.text(256, total=4100, side="last"):
        assert SOL.arguments(4100, Knob("threshold", 1.3))["sink_q"] == [60, 65]   # tokens 3844-4100
    assert SOL.arguments(4096, Knob("topk", 0.2))["sink_blocks"] is None
    for bad, what in ((-1, "tokens -1 is not a whole number"), (1.5, "tokens 1.5 is not a whole number"),
                      ("77", "tokens '77' is not a whole number"), (True, "tokens True is not a whole number")):
        with pytest.raises(ValueError, match=f"conditioning {what}"):
            with conditioning.text(bad, total=4096):
                pass
    with pytest.raises(ValueError, match="conditioning side 'middle' is not one of first, last"):
        with conditioning.text(10, total=4096, side="middle"):
            pass
    with pytest.raises(ValueError, match="conditioning tokens 5000 exceed the joint sequence's 4096"):
        with conditioning.text(5000, total=4096):
            pass


def test_calibration_goes_from_the_users_tau_down_to_denser_ones():
    assert [k.value for k in SOL.ladder(Knob("threshold", 1.3))] == [1.3, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert [k.value for k in SOL.ladder(Knob("threshold", 4.0))][:3] == [4.0, 3.0, 2.5]
    assert [k.value for k in SOL.ladder(Knob("topk", 0.2))] == [0.2, 0.25, 0.3, 0.4, 0.5]
    assert SOL.threshold_problem(1.0) == ""
    assert SOL.threshold_problem(4.5).startswith("threshold 4.5 is outside sol's range 0-4 (tau:")


def _token_level_routing(q, k, scale, knob, sinks):
    """The routing as the reference states it: every query token's scores against each key block's mean
    key (centred), averaged over the query block, against tau sigmas of the centroid's spread or top-k."""
    b, t, h, d = q.shape
    n = math.ceil(t / 64)
    qh = q.double().transpose(1, 2)
    km = torch.stack([k[:, i * 64:(i + 1) * 64].double().mean(1) for i in range(n)], 1).transpose(1, 2)
    kc = km - km.mean(2, keepdim=True)
    per_token = (qh @ kc.transpose(-1, -2)) * scale * sol.LOG2E                   # (b, h, t, n)
    col = torch.stack([per_token[:, :, i * 64:(i + 1) * 64].mean(2) for i in range(n)], 2)
    centroid = torch.stack([qh[:, :, i * 64:(i + 1) * 64].mean(2) for i in range(n)], 2)
    idx = torch.arange(n)
    sink = (idx >= (sinks or (0, 0))[0]) & (idx < (sinks or (0, 0))[1])
    if knob.name == "topk":
        ranked = col.masked_fill(sink, float("-inf"))
        kk = max(0, min(n - 1, max(1, round(knob.value * (n - int(sink.sum()))))))
        exact = ranked >= ranked.topk(kk, -1).values[..., -1:]
    else:
        var = (centroid.pow(2) * kc.pow(2).mean(2, keepdim=True)).sum(-1, keepdim=True)
        exact = col > knob.value * torch.sqrt(var * (scale * sol.LOG2E) ** 2 + 1e-6)
    # sink_q, which the engine passes equal to the sinks: those query blocks attend every key block exactly
    return exact | ((idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1) | sink | sink.view(-1, 1)


@pytest.mark.parametrize("knob", [Knob("threshold", 1.3), Knob("threshold", 0.25), Knob("topk", 0.2),
                                  Knob("topk", 0.5)])
@pytest.mark.parametrize("sinks", [None, [0, 3], [6, 8]])
def test_the_share_of_blocks_it_reports_is_the_routings_share(knob, sinks):
    g = torch.Generator().manual_seed(7)
    pos = torch.arange(1280, dtype=torch.float64).view(-1, 1)
    wave = torch.cat([(pos / w).cos() for w in (3.0, 9.0, 27.0, 81.0)] * 32, 1)  # (t, 128): local structure
    q, k = ((wave + 0.5 * torch.randn(1280, 128, generator=g, dtype=torch.float64)).view(1, 1280, 1, 128)
            .expand(2, 1280, 2, 128).float() for _ in range(2))
    scale = 128 ** -0.5
    want = _token_level_routing(q, k, scale, knob, sinks)
    got = sol.routed_blocks(sol._block_means(q), sol._block_means(k), scale, knob, sinks)
    assert torch.equal(got, want)
    share = sol.routed_share(q, k, scale, knob, sinks)
    assert share.shape == () and float(share) == pytest.approx(want.double().mean().item(), abs=1e-6)
    assert 3 * 20 - 2 <= want[0, 0].sum() < 400                                        # diagonal band at least
    old = sol.ROUTING_CHUNK
    try:
        sol.ROUTING_CHUNK = 1  # one head at a time: the same share
        assert float(sol.routed_share(q, k, scale, knob, sinks)) == pytest.approx(float(share), abs=1e-6)
    finally:
        sol.ROUTING_CHUNK = old


def _stand_in(monkeypatch, *, with_sol=True, version="0.2.40"):
    """comfy-kitchen as 0.2.40 names its modules; ``sol_attn`` checks what its call rule checks, records
    its arguments and computes exact attention."""
    calls = []

    def sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None, topk_ratio=0.0,
                 tail=True, block_len=None, coarse_gate=None, token_aug=0):
        for name, other in (("k", k), ("v", v)):
            if other.shape != q.shape or other.dtype != q.dtype:
                raise ValueError(f"sol_attn: {name}: must have the same shape and dtype as q")
        if q.shape[-1] != 128:
            raise ValueError("sol_attn: q: head_dim must be 128")
        calls.append({"shape": tuple(q.shape), "contiguous": q.is_contiguous(), "tau": tau, "scale": scale,
                      "sink_blocks": sink_blocks, "sink_q": sink_q, "topk_ratio": topk_ratio})
        out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                                               scale=scale)
        return out.transpose(1, 2).to(v.dtype).contiguous()

    package = types.ModuleType("comfy_kitchen")
    package.__version__ = version
    package.__path__ = []
    package.sol_attn_is_available = lambda device=None: device is not None and device.type == "cuda"
    if with_sol:
        package.sol_attn = sol_attn
    backends = types.ModuleType("comfy_kitchen.backends")
    backends.__path__ = []
    cuda = types.ModuleType("comfy_kitchen.backends.cuda")
    cuda._EXT_AVAILABLE, cuda._EXT_ERROR = True, None
    for name, module in (("comfy_kitchen", package), ("comfy_kitchen.backends", backends),
                         ("comfy_kitchen.backends.cuda", cuda)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_the_probe_finds_sol_attn_or_says_what_is_missing(monkeypatch):
    _stand_in(monkeypatch)
    assert SOL._probe().available and SOL.fn is not None
    _stand_in(monkeypatch, with_sol=False, version="0.2.8")
    assert SOL._probe().reason == "comfy-kitchen 0.2.8 has no sol_attn (0.2.40 has)"
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)
    found = SOL.probe()
    assert not found.available and found.reason.startswith("ModuleNotFoundError")
    assert found.reason.endswith("hub: no kernel hub build of Sol-Attn is known to the engine; comfy-kitchen's "
                                 "wheel carries it (compiled for NVIDIA Ampere and newer and AMD RDNA3 and newer; "
                                 "elsewhere an eager reference, slower than dense)")


def test_a_sparse_call_reaches_sol_attn_in_its_layout_with_scale_knob_and_sinks(monkeypatch):
    calls = _stand_in(monkeypatch)
    SOL._probe()
    g = torch.Generator().manual_seed(3)
    # (b, t, 3, h, d) projections viewed per tensor, as a DiT passes them: the kernels load such views
    qkv = torch.randn(1, 640, 3, 2, 128, generator=g)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    kept = [x.clone() for x in (q, k, v)]
    with conditioning.text(70, total=640):
        result = SOL.run_sparse(q, k, v, 0.09, Knob("topk", 0.3))
    assert calls == [{"shape": (1, 640, 2, 128), "contiguous": False, "tau": 1.0, "scale": 0.09,
                      "sink_blocks": [0, 2], "sink_q": [0, 2], "topk_ratio": 0.3}]
    assert result.lse is None and result.out.shape == q.shape
    assert rel_err(result.out, reference(q, k, v, None, 0.09, "bshd")) < 1e-5
    assert 0 < result.share() <= 1
    assert all(torch.equal(a, b) for a, b in zip(kept, (q, k, v)))
    # a view whose rows are 130 wide and start 4 bytes in: the 16-byte loads would be misaligned
    odd = torch.randn(1, 640, 2, 130, generator=g)[..., 1:129]
    result = SOL.run_sparse(odd, odd, odd, None, Knob("threshold", 1.3))
    assert calls[-1]["contiguous"] and calls[-1]["tau"] == 1.3 and calls[-1]["scale"] is None
    assert rel_err(result.out, reference(odd, odd, odd, None, None, "bshd")) < 1e-5


def test_a_gpu_without_its_compiled_kernels_is_refused_unless_sol_is_named(monkeypatch):
    # sol_attn there would run the eager reference: every score in fp32, slower than dense attention
    _stand_in(monkeypatch)
    asked_for = []
    sys.modules["comfy_kitchen"].sol_attn_is_available = lambda device=None: asked_for.append(device) or False
    SOL._probe()
    (why,) = SOL.reasons(spec())
    assert why.startswith("no compiled Sol-Attn kernels on this device (sol_attn_is_available() is False)")
    assert SOL.reasons(spec(dtype=torch.float16, device=RDNA3)) == [why]
    assert asked_for == [torch.device("cuda", 0)]                      # asked once per device
    assert SOL.reasons(spec(q=4096), asked=True) == []                 # named: the user asked for it
    assert SOL.reasons(spec(q=32768, h=2), asked=True) == [
        "cuda: Sol-Attn's eager reference would hold 8.0 GiB of scores (its limit: 4 GiB)"]
    sys.modules["comfy_kitchen.backends.cuda"]._EXT_AVAILABLE = False
    sys.modules["comfy_kitchen.backends.cuda"]._EXT_ERROR = "libcudart.so.13: cannot open shared object file"
    SOL._probe()
    assert SOL.reasons(spec())[0].startswith("no compiled Sol-Attn kernels on this device (its compiled extension "
                                             "did not load: libcudart.so.13: cannot open shared object file)")
    sys.modules["comfy_kitchen"].sol_attn_is_available = lambda device=None: True
    SOL._probe()
    assert SOL.reasons(spec()) == [] and SOL.reasons(spec(TURING)) == ["GPU sm75 < sm80 (Sol-Attn's compiled kernels)"]
    (cpu,) = SOL.reasons(spec(CPU, dtype=torch.float32))
    assert cpu.startswith("cpu: Sol-Attn runs its eager reference here")


@pytest.fixture
def fresh_probes():
    reset_probes()
    lib_attn.reset()
    yield
    lib_attn.reset()
    reset_probes()


def test_a_script_naming_sol_where_it_cannot_run_is_refused_with_what_to_do(monkeypatch, fresh_probes):

    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # not installed
    with pytest.raises(lib_attn.SparseError) as refused:
        lib_attn.configure(sparse="sol, budget=0.2")
    text = str(refused.value)
    assert text.startswith("sparse method 'sol' cannot run on this device (cpu: ") and "comfy_kitchen" in text
    assert "To install: pip install comfy-kitchen" in text and "ATTN_INSTALL" not in text
    assert text.endswith("Methods that can run here: auto, block-sparse; or 'off' for none")
    assert lib_attn.config().sparse is None                       # nothing changed
    with pytest.raises(lib_attn.SparseError, match="sparse method 'sol' cannot run"):
        with lib_attn.use(sparse={"method": "sol"}):
            pass
    assert lib_attn.sparse.parse("sol").method == "sol"         # a paste of settings is only read: never refused
    lib_attn.configure(sparse="block-sparse")                   # one that runs here is taken

    _stand_in(monkeypatch)  # installed: compiled kernels on sm80+, the eager reference on a CPU when named
    sys.modules["comfy_kitchen"].sol_attn_is_available = lambda device=None: True
    reset_probes()
    settings = lib_attn.sparse.parse("sol")
    assert sparse_problem(settings, CPU) == "" and sparse_problem(settings, A100) == ""
    turing = sparse_problem(settings, TURING)
    assert turing.startswith("sparse method 'sol' cannot run on this device (cuda: RTX 2080 (sm75)), every call "
                             "would run dense: sol: GPU sm75 < sm80 (Sol-Attn's compiled kernels)")
    assert "pip install" not in turing                            # installed: nothing to install
    # under auto the eager reference never runs: a CPU has block-sparse, so auto is taken
    assert sparse_problem(lib_attn.sparse.parse("auto"), CPU) == ""
    # the eager reference's own limit holds for every call of min_tokens or more
    assert "would hold 6.0 GiB of scores" in sparse_problem(lib_attn.sparse.parse("sol, min_tokens=40000"), CPU)


def test_a_host_keeps_sol_where_it_cannot_run_its_calls_run_dense_and_say_why(monkeypatch, fresh_probes):
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)
    lib_attn.configure(sparse="sol, dense=none", hosted=True)     # a webui's setting, a node's input
    assert lib_attn.config().sparse.method == "sol"
    q = torch.randn(1, 12288, 1, 128)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, q, q, role="dit", layout="bshd")
    assert torch.equal(out, lib_attn.attention(q, q, q, role="dit", layout="bshd", backend="sdpa"))
    ((role, reason), n), = rec.sparse.dense.items()
    assert (role, n) == ("dit", 1) and reason.startswith("sol: not available: ModuleNotFoundError: import of comfy_kitchen")
    assert "ATTN_INSTALL" not in reason and "comfy-kitchen's wheel carries it" in reason
    with lib_attn.use(sparse="sol", hosted=True) as cfg:
        assert cfg.sparse.method == "sol"
