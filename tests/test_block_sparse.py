"""The native block-sparse backend: routing from pooled scores (top-k and threshold, the sink and diagonal
kept), and both designs computing exactly the attention its routing keeps (with the unrouted blocks'
pooled term), against float64."""
from __future__ import annotations

import math
import random

import pytest
import torch

from lib_attn.kernels import REGISTRY
from lib_attn.kernels.block_sparse import flex, gather
from lib_attn.kernels.block_sparse.routing import blocks, route
from lib_attn.commands.bench.inputs import rope_inputs
from lib_attn.kernels.sparse import Knob
from lib_attn import sparse_measure as measure
from tests.engine_helpers import make_qkv, reference, rel_err


def routed_mask(routing, n: int, kv: int, block: int) -> torch.Tensor:
    """The (b, h, n, kv) bool mask of the (query block, key block) pairs ``routing`` keeps."""
    b, h, nq, width = routing.indices.shape
    keep = torch.zeros(b, h, nq, blocks(kv, block), dtype=torch.bool)
    counts = routing.counts if routing.counts is not None else torch.full((b, h, nq), width)
    for bi in range(b):
        for hi in range(h):
            for i in range(nq):
                keep[bi, hi, i, routing.indices[bi, hi, i, :counts[bi, hi, i]]] = True
    rows = keep.repeat_interleave(block, dim=2)[:, :, :n]
    return rows.repeat_interleave(block, dim=3)[..., :kv]


@pytest.mark.parametrize("n, knob", [(512, Knob("topk", 0.3)), (700, Knob("topk", 0.5)), (700, Knob("threshold", 0.6)),
                                     (333, Knob("threshold", 0.9)), (1000, Knob("topk", 1.0))])
def test_gather_computes_the_routed_attention_exactly(n, knob):
    block = 64
    q, k, v = make_qkv(2, 3, n, n, 16, torch.float64)
    scale = 1 / math.sqrt(16)
    routing = route(q, k, scale, block, knob.name, knob.value)
    out = gather.run(q, k, v, scale, routing, block)
    ref = reference(q, k, v, mask=routed_mask(routing, n, n, block))
    assert rel_err(out, ref) < 1e-12
    if knob.value == 1.0:
        assert rel_err(out, reference(q, k, v)) < 1e-12 and float(routing.kept) == 1.0
    # the routing's own per-row view of the keys it keeps (what calibration masks scores with) is the same
    rows = torch.tensor([0, 5, n // 2, n - 1])
    mask = routed_mask(routing, n, n, block)
    for bi, hi in ((0, 0), (1, 2)):
        assert torch.equal(routing.keeps(bi, hi, rows, n), mask[bi, hi, rows])


def pooled_reference(q, k, v, scale, routing) -> torch.Tensor:
    """Float64 attention over the routed blocks plus, for every other key block, one term: the block's mean
    key with its score raised by the log of its token count, and its mean value."""
    q, k, v = (t.double() for t in (q, k, v))
    b, h, n, _ = q.shape
    kv, block, nk = k.shape[2], routing.block, routing.key_blocks
    out = torch.empty(b, h, n, v.shape[-1], dtype=torch.float64)
    sizes = torch.tensor([min(block, kv - j * block) for j in range(nk)], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            keep = routing.kept_blocks(bi, hi, torch.arange(n))
            scores = (q[bi, hi] @ k[bi, hi].T) * scale
            tokens = scores.masked_fill(~keep.repeat_interleave(block, 1)[:, :kv], -math.inf)
            k_means = torch.stack([k[bi, hi, j * block:(j + 1) * block].mean(0) for j in range(nk)])
            v_means = torch.stack([v[bi, hi, j * block:(j + 1) * block].mean(0) for j in range(nk)])
            pooled = ((q[bi, hi] @ k_means.T) * scale + sizes.log()).masked_fill(keep, -math.inf)
            p = torch.softmax(torch.cat([tokens, pooled], 1), 1)
            out[bi, hi] = p[:, :kv] @ v[bi, hi] + p[:, kv:] @ v_means
    return out


@pytest.mark.parametrize("merged", [True, False], ids=["second-pass", "joined-keys"])
@pytest.mark.parametrize("n, knob", [(512, Knob("topk", 0.3)), (700, Knob("threshold", 0.6)), (333, Knob("topk", 0.5))])
def test_gather_counts_the_unrouted_blocks_through_their_pooled_term(n, knob, merged, monkeypatch):
    # both ways of the pooled term: a second pass merged by log-sum-exp (CPU, torch 2.3 and later), and the
    # mean keys joined to the gathered ones under an additive mask (elsewhere)
    if merged and not gather.merges_lse("cpu"):
        pytest.skip("PyTorch's CPU SDPA operator returns its log-sum-exp and takes a mask from torch 2.3")
    monkeypatch.setattr(gather, "merges_lse", lambda device_type: merged)
    block = 64
    q, k, v = make_qkv(2, 3, n, n, 16, torch.float64, seed=5)
    scale = 0.25
    routing = route(q, k, scale, block, knob.name, knob.value, pooled_rest=True)
    out = gather.run(q, k, v, scale, routing, block)
    assert rel_err(out, pooled_reference(q, k, v, scale, routing)) < 1e-6  # the means are taken in fp32
    # calibration's measurement of the pooled routing is the kernel's error on the same rows
    samples = measure.draw(q, "bhsd", random.Random(2))
    assert measure.routed_errors(q, k, v, scale, "bhsd", [routing], samples)[0] == pytest.approx(
        measure.output_error(out, q, k, v, scale, "bhsd", samples), rel=1e-4)


def test_the_pooled_term_is_closer_to_exact_attention_on_rope_inputs():
    # q and k holding only a RoPE position term (plus noise): attention spread over many nearby blocks
    q, k, v = (t.contiguous() for t in rope_inputs(1, 2, (4, 16, 32), 64, torch.float64, torch.device("cpu"), seed=1,
                                                   strength=0.5))
    exact = reference(q, k, v)
    scale = 64 ** -0.5
    for topk in (0.2, 0.3):
        plain = gather.run(q, k, v, scale, route(q, k, scale, 128, "topk", topk), 128)
        pooled = gather.run(q, k, v, scale, route(q, k, scale, 128, "topk", topk, pooled_rest=True), 128)
        assert rel_err(pooled, exact) < 0.75 * rel_err(plain, exact)


def test_routing_keeps_sink_and_diagonal_and_the_highest_pooled_scores():
    q, k, _ = make_qkv(1, 2, 640, 640, 8, torch.float64, seed=3)
    routing = route(q, k, 0.5, 64, "topk", 0.3)
    assert routing.indices.shape == (1, 2, 10, 3) and routing.counts is None
    for i in range(10):
        kept = set(routing.indices[0, 0, i].tolist())
        assert 0 in kept and i in kept
    assert abs(float(routing.kept) - 0.3) < 1e-6
    # with a sink and a diagonal forced, the third block is the best of the rest
    pooled_q = q[0, 0].view(10, 64, 8).mean(1)
    pooled_k = k[0, 0].view(10, 64, 8).mean(1)
    s = pooled_q @ pooled_k.T
    for i in range(10):
        rest = [j for j in range(10) if j not in (0, i)]
        best = max(rest, key=lambda j: float(s[i, j]))
        assert best in routing.indices[0, 0, i].tolist()


def test_threshold_keeps_more_blocks_as_it_rises():
    q, k, _ = make_qkv(1, 2, 1024, 1024, 16, torch.float32, seed=1)
    kept = [float(route(q, k, 0.25, 64, "threshold", t).kept) for t in (0.3, 0.6, 0.9, 1.0)]
    assert kept == sorted(kept) and kept[-1] == 1.0 and kept[0] < kept[-1]


def test_backend_runs_bshd_views_and_half_inputs_via_its_contract():
    backend = REGISTRY["block-sparse"]
    q, k, v = make_qkv(1, 2, 300, 300, 32, torch.float32)
    result = backend.run_sparse(q, k, v, None, Knob("topk", 1.0))
    assert torch.equal(backend.routing(q, k, None, Knob("topk", 0.4)).indices,
                       route(q, k, 1 / math.sqrt(32), 128, "topk", 0.4).indices)
    assert result.lse is None and not backend.returns_lse and float(result.kept) == 1.0
    assert rel_err(result.out, reference(q, k, v)) < 1e-5
    qb, kb, vb = (t.to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    half = backend.run_sparse(qb, kb, vb, None, Knob("topk", 1.0)).out
    assert half.dtype == torch.bfloat16 and rel_err(half, reference(qb, kb, vb)) < 4e-2
    with pytest.raises(NotImplementedError, match="no mask"):
        backend.run(q, k, v, torch.ones(300, 300, dtype=torch.bool), None)


@pytest.mark.skipif(not flex.available(), reason="FlexAttention arrived in torch 2.5")
def test_flex_design_computes_the_routed_attention():
    torch._dynamo.reset()  # this test's shapes compile on their own (earlier ones would make them dynamic)
    flex._warm.clear()
    n, block = 600, 128  # a last block of 88 tokens
    q, k, v = make_qkv(1, 2, n, n, 32, torch.float32, seed=4)
    for knob in (Knob("topk", 0.4), Knob("threshold", 0.7), Knob("topk", 1.0)):
        routing = route(q, k, 0.25, block, knob.name, knob.value)
        with torch.no_grad():
            out, lse = flex.run(q, k, v, 0.25, routing, block)
        assert lse is None  # compiled FlexAttention on a CPU returns none
        assert rel_err(out, reference(q, k, v, mask=routed_mask(routing, n, n, block), scale=0.25)) < 1e-5
        pooled = route(q, k, 0.25, block, knob.name, knob.value, pooled_rest=True)
        with torch.no_grad():
            out, _ = flex.run(q, k, v, 0.25, pooled, block)
        assert rel_err(out, pooled_reference(q, k, v, 0.25, pooled)) < 1e-5
    backend = REGISTRY["block-sparse"]
    # the pooled routing runs FlexAttention on CUDA; on a CPU the gather design (see POOLED_FLEX_DEVICES)
    assert backend.design("cuda") == "flex" and backend.design("cpu") == "gather" and backend.design("mps") == "gather"
    assert rel_err(backend.run_sparse(q, k, v, 0.25, Knob("topk", 1.0)).out, reference(q, k, v, scale=0.25)) < 1e-5


def test_a_compiler_that_fails_leaves_the_gather_design(monkeypatch, caplog):
    backend = type(REGISTRY["block-sparse"])()
    backend.pooled = False  # FlexAttention runs the routed blocks alone on a CPU

    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile error: no compiler")

    monkeypatch.setattr(flex, "available", lambda: True)
    monkeypatch.setattr(flex, "run", broken)
    q, k, v = make_qkv(1, 2, 300, 300, 16, torch.float64, seed=2)
    out = backend.run_sparse(q, k, v, None, Knob("topk", 1.0)).out
    assert rel_err(out, reference(q, k, v)) < 1e-12
    assert backend.design("cpu", torch.float64, 16) == "gather"
    assert "no compiler" in backend.flex_failures[("cpu", torch.float64, 16)]
    assert backend.design("cpu", torch.float32, 16) == "flex"  # another dtype: not failed there
    assert "gather design serves" in caplog.text


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_gather_second_pass_holds_half_and_single_precision_to_their_bounds(dtype, bound):
    # the routed blocks in the call's dtype, the pooled pass and the merge in fp32: the error against float64
    # is the dtype's, on a call whose last blocks are short (1,000 tokens, 64-token blocks)
    if not gather.merges_lse("cpu"):
        pytest.skip("PyTorch's CPU SDPA operator returns its log-sum-exp and takes a mask from torch 2.3")
    q, k, v = make_qkv(1, 2, 1000, 1000, 32, torch.float64, seed=7)
    routing = route(q, k, 0.2, 64, "topk", 0.3, pooled_rest=True)
    exact = pooled_reference(q, k, v, 0.2, routing)
    out = gather.run(*(t.to(dtype) for t in (q, k, v)), 0.2, routing, 64)
    assert out.dtype == dtype and rel_err(out, exact) < bound

