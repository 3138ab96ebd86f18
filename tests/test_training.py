"""Training through the engine: every call whose inputs need gradients returns an output with its
autograd graph, from the first call of each signature, whatever the engine does beside it (the
guard's checks, tuning's measurements, sparse calibration); backends without a backward never take
such a call; calls recomputed by activation checkpointing are counted apart."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import lib_attn
from lib_attn.kernels import REGISTRY
from tests.engine_helpers import make_qkv, rel_err

MODES = {
    "guard on": {"guard": "on"},
    "guard off": {"guard": "off"},
    "guard full": {"guard": "full"},
    "tuning on": {"tune": "on"},
    "sparse on": {"sparse": "block-sparse, budget=0.15"},
}


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    yield
    lib_attn.reset()


def sdpa_grads(q, k, v, mask, layout, weight):
    """Output and gradients of PyTorch's SDPA on copies of q, k, v, for the loss (out * weight).sum()."""
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    args = (q2, k2, v2) if layout == "bhsd" else (q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2))
    out = F.scaled_dot_product_attention(*args, attn_mask=mask)
    out = out if layout == "bhsd" else out.transpose(1, 2)
    (out * weight).sum().backward()
    return out.detach(), (q2.grad, k2.grad, v2.grad)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout,masked", [("bhsd", False), ("bshd", False), ("bhsd", True)])
def test_first_call_has_its_graph_and_sdpas_gradients(mode, layout, masked):
    lib_attn.configure(**MODES[mode])
    b, h, n, d = 2, 3, 40, 16
    for call in range(3):  # the first call of the signature, and the ones after it
        q, k, v = (t.requires_grad_() for t in make_qkv(b, h, n, n, d, torch.float64, layout=layout))
        mask = torch.rand(b, 1, 1, n) > 0.3 if masked else None
        if mask is not None:
            mask[..., 0] = True
        weight = torch.randn(q.shape, dtype=torch.float64)
        out = lib_attn.attention(q, k, v, layout=layout, mask=mask)
        assert out.requires_grad and out.grad_fn is not None, (mode, call)
        (out * weight).sum().backward()
        want, grads = sdpa_grads(q, k, v, mask, layout, weight)
        assert rel_err(out.detach(), want) < 1e-10, (mode, call)
        for name, t, g in zip("qkv", (q, k, v), grads):
            assert t.grad is not None and rel_err(t.grad, g) < 1e-10, (mode, call, name)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_loss_through_attention_alone_trains_from_the_first_call(mode):
    lib_attn.configure(**MODES[mode])
    proj = torch.nn.Linear(16, 16, dtype=torch.float64)
    x = torch.randn(1, 2, 24, 16, dtype=torch.float64)
    out = lib_attn.attention(proj(x), x, x)  # only q carries a graph, and only through attention
    out.pow(2).mean().backward()
    assert proj.weight.grad is not None and float(proj.weight.grad.abs().sum()) > 0


def test_inference_calls_are_unchanged_by_gradient_handling():
    # The same signature with and without gradients: two decisions, the inference one adds nothing.
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float64)
    with torch.no_grad():
        out = lib_attn.attention(q, k, v)
    assert not out.requires_grad
    inference = lib_attn.explain(q, k, v)
    assert not inference.spec.requires_grad and "gradients" not in str(inference)
    q.requires_grad_()
    training = lib_attn.explain(q, k, v)
    assert training.spec.requires_grad and f"gradients: {training.backend}'s own backward" in str(training)
    assert inference.run is not training.run


class Forward(lib_attn.Backend):
    """A CPU kernel with no backward pass, as SageAttention and the INT8 kernels are."""

    id = "forward-only"
    label = "forward only (test)"
    devices = ("cpu",)
    dtypes = (torch.float32, torch.float64)
    backward = False

    def __init__(self):
        self.calls = 0

    def run(self, q, k, v, mask, scale):
        self.calls += 1
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def test_a_backend_without_backward_never_takes_a_call_that_needs_gradients():
    fwd = Forward()
    lib_attn.register_backend(fwd)
    try:
        lib_attn.configure(preference=["forward-only", "sdpa"])
        q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float64)
        with lib_attn.recording() as rec:
            with torch.no_grad():
                lib_attn.attention(q, k, v)
            ran_inference = fwd.calls
            for _ in range(2):
                q.requires_grad_()
                out = lib_attn.attention(q, k, v)
                assert out.requires_grad
                out.sum().backward()
        assert ran_inference >= 1 and fwd.calls == ran_inference  # it served inference, never training
        assert rec.calls[("unet", "forward-only")] == 1 and rec.calls[("unet", "sdpa")] == 2
        assert rec.fallbacks == {("unet", "forward-only", "no backward pass (inference only)"): 2}
        assert "no backward pass" in str(lib_attn.explain(q, k, v))
    finally:
        lib_attn.unregister_backend("forward-only")


class Block(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=torch.float64)
        self.out = torch.nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x, attend):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        return x + self.out(attend(q, k, v).reshape(b, n, c))


@pytest.mark.parametrize("mode", list(MODES))
def test_gradient_checkpointing_recomputes_through_the_engine(mode):
    lib_attn.configure(**MODES[mode])
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    x = torch.randn(2, 48, 32, dtype=torch.float64)

    def engine(q, k, v):
        return lib_attn.attention(q, k, v, layout="bshd")

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def loss(attend, ckpt):
        h = x
        for blk in blocks:
            h = checkpoint(blk, h, attend, use_reentrant=False) if ckpt else blk(h, attend)
        return h.pow(2).mean()

    loss(plain, False).backward()
    want = [p.grad.clone() for p in blocks.parameters()]
    for step in range(2):  # the first step meets the signature for the first time
        blocks.zero_grad()
        with lib_attn.recording() as rec:
            loss(engine, True).backward()  # recomputed metadata differing would raise CheckpointError
        for p, w in zip(blocks.parameters(), want):
            assert rel_err(p.grad, w) < 1e-10, (mode, step)
        ran = sum(rec.calls.values())
        assert ran == 4 and sum(rec.recomputed.values()) == 2, (mode, step, rec.calls, rec.recomputed)
    report = lib_attn.Report.from_recording(rec)
    assert lib_attn.Report.from_dict(report.to_dict()).recomputed == report.recomputed == dict(rec.recomputed)


def test_recomputed_calls_are_told_from_forward_ones_per_backend():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 16, 16, 16, torch.float64))
    with lib_attn.recording() as rec:
        checkpoint(lambda a, b, c: lib_attn.attention(a, b, c), q, k, v, use_reentrant=False).sum().backward()
        lib_attn.attention(q, k, v).sum().backward()
    backend = lib_attn.explain(q, k, v).backend
    assert rec.calls == {("unet", backend): 3}
    assert rec.recomputed == {("unet", backend): 1}
    assert lib_attn.Report.from_recording(rec).to_dict()["recomputed"] == [
        {"role": "unet", "backend": backend, "count": 1}]


def test_sparse_runs_dense_for_calls_that_need_gradients_and_says_why():
    lib_attn.configure(**MODES["sparse on"])
    q, k, v = make_qkv(1, 2, 256, 256, 16, torch.float32)
    with lib_attn.recording() as rec:
        for _ in range(2):
            q.requires_grad_()
            out = lib_attn.attention(q, k, v, role="dit")
            assert out.requires_grad
            out.sum().backward()
    assert rec.sparse is not None
    dense = rec.sparse.to_dict()
    assert "gradients needed" in str(dense)
    assert all(b in {bid for bid in REGISTRY} and b != "block-sparse" for _, b in rec.calls)


@pytest.mark.parametrize("mode,preference,dtype", [
    ("guard on", None, torch.float64), ("guard off", None, torch.float64), ("tuning on", None, torch.float64),
    ("guard on", ["sdpa-efficient"], torch.float32), ("guard on", ["sdpa-math"], torch.float64)])
def test_a_learned_bias_alone_gets_its_gradient_from_the_first_call(mode, preference, dtype):
    # A float mask that requires grad (a learned relative-position bias) needs the graph as q, k and v do.
    lib_attn.configure(**MODES[mode], **({"preference": preference} if preference else {}))
    b, h, n, d = 2, 3, 40, 16
    for call in range(2):
        q, k, v = make_qkv(b, h, n, n, d, dtype)
        bias = torch.randn(1, h, n, n, dtype=dtype, requires_grad=True)
        out = lib_attn.attention(q, k, v, mask=bias)
        assert out.grad_fn is not None, call
        out.sum().backward()
        want = bias.detach().clone().requires_grad_()
        F.scaled_dot_product_attention(q, k, v, attn_mask=want).sum().backward()
        assert rel_err(bias.grad, want.grad) < (1e-10 if dtype == torch.float64 else 1e-5), call


def test_inputs_the_guard_puts_back_keep_the_callers_graph():
    """A kernel that writes into q's memory on long calls, as a GPU kernel does (past autograd): the
    guard restores q, and a backward that saved q (made by an exp) still runs and gives SDPA's gradients."""
    from tests import faulty_backends

    class RawScale(faulty_backends._WritesWhenLong):
        id, label = "fk-raw-long", "pre-scales q's memory by 1/8 on long calls"

        def write(self, q, k):
            q.data.mul_(0.125)

    lib_attn.register_backend(RawScale())
    try:
        lib_attn.configure(preference=["fk-raw-long", "sdpa"])
        n = faulty_backends.LONG + 200
        x, k, v = (t.requires_grad_() for t in make_qkv(1, 2, n, n, 16, torch.float32))
        q = x.exp()  # exp keeps its output for its backward
        out = lib_attn.attention(q, k, v)
        assert lib_attn.explain(q, k, v).backend == "sdpa"
        out.sum().backward()
        x2, k2, v2 = (t.detach().clone().requires_grad_() for t in (x, k, v))
        want = F.scaled_dot_product_attention(x2.exp(), k2, v2)
        want.sum().backward()
        assert rel_err(out.detach(), want.detach()) < 1e-5
        for got, ref in ((x.grad, x2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            assert rel_err(got, ref) < 1e-4
    finally:
        lib_attn.unregister_backend("fk-raw-long")


def test_a_write_through_autograd_on_long_calls_is_never_recomputed_into_wrong_gradients():
    """A kernel that pre-scales q in place with a torch op on long calls: with q needing gradients, the
    write enters q's autograd history, which putting the values back cannot undo. The call raises (it
    cannot be recomputed with right gradients) and the kernel is rejected, so the step run again is right."""
    from tests import faulty_backends

    faulty_backends.register()
    try:
        lib_attn.configure(preference=["fk-scale-long", "sdpa"])
        n = faulty_backends.LONG + 200
        x = make_qkv(1, 2, n, n, 16, torch.float32)[0].requires_grad_()
        k, v = make_qkv(1, 2, n, n, 16, torch.float32)[1:]
        with pytest.raises(RuntimeError, match="through autograd"):
            lib_attn.attention(x * 1.0, k, v)
        out = lib_attn.attention(x * 1.0, k, v)   # the step again: on sdpa
        out.sum().backward()
        x2 = x.detach().clone().requires_grad_()
        F.scaled_dot_product_attention(x2 * 1.0, k, v).sum().backward()
        assert rel_err(x.grad, x2.grad) < 1e-5
    finally:
        faulty_backends.unregister()
