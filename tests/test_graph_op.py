"""The engine under torch.compile: one opaque operator, decided and counted when it runs."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import _compat, graph_op

from engine_helpers import reference, rel_err, spy

needs_custom_op = pytest.mark.skipif(_compat.CUSTOM_OP is None, reason="torch.library.custom_op needs torch 2.4")

OP = "lib_attn.attention.default"


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    lib_attn.reset()
    torch._dynamo.reset()


def graphs(fn):
    """Compile ``fn`` with a backend that keeps every FX graph it is given."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward
    return torch.compile(fn, backend=backend), seen


def attend(x, layout):
    q = x * 2
    return lib_attn.attention(q, x, x, layout=layout, role="dit") + 1


@needs_custom_op
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_traced_call_is_the_custom_operator(layout):
    compiled, seen = graphs(lambda x: attend(x, layout))
    x = torch.randn(2, 3, 16, 8)
    with lib_attn.recording() as rec:
        out = compiled(x)
    targets = [str(n.target) for gm in seen for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(OP) == 1, targets
    assert not any("scaled_dot_product" in t for t in targets), targets
    assert rel_err(out, reference(x * 2, x, x, layout=layout) + 1) < 1e-5
    assert rec.calls == {("dit", "sdpa"): 1}


@needs_custom_op
def test_compiled_function_one_graph_counts_per_run_and_config_after_compiling(monkeypatch):
    sdpa_ran, math_ran = spy(monkeypatch, "sdpa"), spy(monkeypatch, "math")
    compiled = torch.compile(lambda x: attend(x, "bshd"))
    x = torch.randn(2, 16, 3, 8)
    want = reference(x * 2, x, x, layout="bshd") + 1
    for run in range(24):
        if run % 2:
            with lib_attn.recording() as rec:
                out = compiled(x)
            assert rec.calls == {("dit", "sdpa"): 1}
        else:
            out = compiled(x)
        assert rel_err(out, want) < 1e-5
    assert len(sdpa_ran) == 24 and not math_ran
    with lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
        out = compiled(x)
    assert rec.calls == {("dit", "math"): 1} and len(math_ran) == 1 and len(sdpa_ran) == 24
    assert rel_err(out, want) < 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@needs_custom_op
def test_compiled_gradients_match_the_reference():
    compiled = torch.compile(lambda q, k, v, m: lib_attn.attention(q, k, v, mask=m, layout="bshd"), backend="aot_eager")
    q, k, v = (torch.randn(2, 12, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 12, 12) > 0.3
    mask[..., 0] = True
    grad = torch.randn(2, 12, 3, 8, dtype=torch.float64)
    out = compiled(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference(q, k, v, mask=mask, layout="bshd")
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel_err(out, ref) < 1e-12
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


def test_eager_calls_do_not_enter_the_operator(monkeypatch):
    def refuse(*args):
        raise AssertionError("the operator ran for an eager call")
    monkeypatch.setattr(graph_op, "_op", refuse)
    q = torch.randn(1, 2, 8, 16)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, q, q)
    assert rel_err(out, reference(q, q, q)) < 1e-5 and rec.calls == {("unet", "sdpa"): 1}


@needs_custom_op
def test_operator_in_eager_mode_runs_the_engine():
    q = torch.randn(1, 2, 8, 16)
    with lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
        out = torch.ops.lib_attn.attention(q, q, q, None, "bhsd", 0.5, "vae", None, None)
    assert rel_err(out, reference(q, q, q, scale=0.5)) < 1e-6 and rec.calls == {("vae", "math"): 1}


def test_compiled_calls_are_decided_and_counted_when_they_run_on_every_torch(monkeypatch):
    """torch 2.4+: the operator; older torch: a graph break around the engine. Either way each run
    counts and the configuration at run time decides."""
    math_ran = spy(monkeypatch, "math")
    compiled = torch.compile(lambda x: attend(x, "bshd"), backend="eager")
    x = torch.randn(2, 16, 3, 8)
    want = reference(x * 2, x, x, layout="bshd") + 1
    with lib_attn.recording() as rec:
        for _ in range(4):
            assert rel_err(compiled(x), want) < 1e-5
    assert rec.calls == {("dit", "sdpa"): 4}
    with lib_attn.use(preference=["math"]), lib_attn.recording() as rec:
        assert rel_err(compiled(x), want) < 1e-5
    assert rec.calls == {("dit", "math"): 1} and len(math_ran) == 1


@needs_custom_op
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compiled_learned_bias_gets_its_gradient(layout):
    # A float mask that requires grad, broadcast over the batch: its gradient summed back to its shape.
    compiled = torch.compile(lambda q, k, v, m: lib_attn.attention(q, k, v, mask=m, layout=layout), backend="aot_eager")
    shape = (2, 3, 12, 8) if layout == "bhsd" else (2, 12, 3, 8)
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 3, 12, 12, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    out = compiled(q, k, v, bias)
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    ref = reference(q, k, v, mask=bias, layout=layout)
    want = torch.autograd.grad(ref, (q, k, v, bias), grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12
