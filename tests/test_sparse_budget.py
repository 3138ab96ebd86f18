"""The sparse error budget over the calls whole runs make, measured against float64 on every call: a
periodic model (every 4th block local), CFG as two model calls per step (cond local, uncond diffuse), a
second model with the same shapes, and the same model with other weights loaded. At most 5% of the calls
may return an output over 1.1 x the budget, and each run still goes sparse where its inputs are local."""
from __future__ import annotations

import contextlib
import gc
import math
import random

import pytest
import torch

import lib_attn
from lib_attn import conditioning
from lib_attn import schedule as sched
from lib_attn.commands.bench.inputs import local_inputs
from lib_attn.kernels.block_sparse import BlockSparse
from lib_attn import sparse_measure as measure
from lib_attn import sparse_plan
from tests.engine_helpers import reference, rel_err

CPU = torch.device("cpu")
GRID = (4, 16, 16)  # 1,024 tokens: 8 blocks of 128
BUDGET = 0.15


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(BlockSparse, "design", lambda self, *args, **kwargs: "gather")  # no compile: fast
    lib_attn.reset()
    sparse_plan.seed(1234)
    lib_attn.configure(sparse={"method": "block-sparse", "min_tokens": 1024, "dense": "none", "budget": BUDGET})
    yield
    lib_attn.reset()
    sched.leave()


def local(seed):
    return local_inputs(1, 1, GRID, 32, torch.float32, CPU, seed=seed, strength=1.0)


def diffuse(seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 1, GRID[0] * GRID[1] * GRID[2], 32, generator=gen) for _ in range(3))


class Block(torch.nn.Module):
    """A block whose self-attention gets fixed q, k, v (local or diffuse); it keeps what the engine
    returned and the true error of each output against float64."""

    def __init__(self, qkv):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        for name, t in zip("qkv", qkv):
            self.register_buffer(name, t.contiguous())
        self.errors: list = []
        self._exact = None

    def forward(self, x):
        out = lib_attn.attention(self.q, self.k, self.v, role="dit")
        if self._exact is None:
            self._exact = reference(self.q, self.k, self.v)
        self.errors.append(rel_err(out, self._exact))
        return x

    def load(self, qkv):
        """Other weights loaded in place (a checkpoint switch): the module stays, its tensors change."""
        with torch.no_grad():
            self.proj.weight.add_(1.0)
            for name, t in zip("qkv", qkv):
                getattr(self, name).copy_(t)
        self._exact = None


class Model(torch.nn.Module):
    def __init__(self, inputs):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(qkv) for qkv in inputs)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def over_share(errors) -> float:
    return sum(e > 1.1 * BUDGET for e in errors) / len(errors)


def test_a_periodic_model_is_held_to_the_budget_and_its_local_blocks_go_sparse():
    # 40 blocks, every 4th local, no position told (no step, no block): 120 calls
    model = Model([local(i) if i % 4 == 0 else diffuse(i) for i in range(40)])
    with lib_attn.recording() as rec:
        for _ in range(3):
            model(torch.zeros(1))
    errors = [e for block in model.blocks for e in block.errors]
    assert len(errors) == 120 and over_share(errors) <= 0.05
    local_errors = [e for i, block in enumerate(model.blocks) if i % 4 == 0 for e in block.errors]
    assert max(local_errors) <= 1.1 * BUDGET
    assert rec.sparse.calls >= 25  # the 10 local blocks' 30 calls go sparse (the rest may be recalibrated)
    assert rec.sparse.error_max() <= BUDGET


def test_a_bare_loop_with_a_period_is_held_to_the_budget():
    # the same calls from one place with nothing to tell them apart: one kind, held by the measurements
    inputs = [local(i) if i % 4 == 0 else diffuse(i) for i in range(8)]
    exact = [reference(*qkv) for qkv in inputs]
    errors = []
    for _ in range(15):
        for qkv, ref in zip(inputs, exact):
            errors.append(rel_err(lib_attn.attention(*qkv, role="dit"), ref))
    assert len(errors) == 120 and over_share(errors) <= 0.05


def test_cfg_as_two_model_calls_keeps_cond_sparse_and_uncond_within_the_budget():
    # the host tells the step at each model call, as diffusers' route and ComfyUI do: 20 steps x 2 x 3 blocks
    cond = Model([local(i) for i in range(3)])
    uncond_inputs = [diffuse(100 + i) for i in range(3)]
    with lib_attn.recording() as rec:
        for step in range(20):
            for call, inputs in enumerate((None, uncond_inputs)):
                sched.at_step(step, 20)
                assert sched.position().call == call
                for i, block in enumerate(cond.blocks):
                    sched.at_block(i, 3)
                    if inputs is None:
                        block(torch.zeros(1))
                    else:  # the same module, the uncond pass's inputs
                        q, k, v = (t.contiguous() for t in inputs[i])
                        saved = block.q, block.k, block.v, block._exact
                        block.q, block.k, block.v, block._exact = q, k, v, None
                        block(torch.zeros(1))
                        block.q, block.k, block.v, block._exact = saved
    errors = [e for block in cond.blocks for e in block.errors]
    assert len(errors) == 120 and over_share(errors) <= 0.05
    cond_errors = [e for block in cond.blocks for e in block.errors[0::2]]
    assert max(cond_errors) <= 1.1 * BUDGET
    labels = {key[2] for key in rec.sparse.kinds}
    assert rec.sparse.calls >= 50 and all("call 2 of the step" not in label for label in labels)
    assert any(reason.startswith("over budget") for (_, reason) in rec.sparse.dense)


@pytest.mark.parametrize("second", ["another model", "other weights loaded"])
def test_a_second_model_with_the_same_shapes_is_calibrated_on_its_own(second):
    first = Model([local(i) for i in range(6)])
    for _ in range(5):
        first(torch.zeros(1))
    if second == "another model":
        model = Model([diffuse(50 + i) if i % 2 else local(50 + i) for i in range(6)])
    else:
        model = first
        for i, block in enumerate(first.blocks):
            block.load(diffuse(50 + i) if i % 2 else local(50 + i))
            block.errors.clear()
    with lib_attn.recording() as rec:
        for _ in range(15):
            model(torch.zeros(1))
    errors = [e for block in model.blocks for e in block.errors]
    assert len(errors) == 90 and over_share(errors) <= 0.05
    assert max(e for i, block in enumerate(model.blocks) if i % 2 == 0 for e in block.errors) <= 1.1 * BUDGET
    assert rec.sparse.calls >= 40


def test_a_model_made_and_run_under_inference_mode_goes_sparse_and_is_told_from_another():
    # ComfyUI loads and runs a prompt's models under torch.inference_mode: their parameters are inference
    # tensors, which keep no version counter
    with torch.inference_mode():
        first = Model([local(0), local(1)])
        with lib_attn.recording() as rec:
            for _ in range(3):
                first(torch.zeros(1))
        assert first.blocks[0].proj.weight.is_inference()
        assert rec.sparse.calls == 6 and not rec.sparse.dense
        second = Model([diffuse(2), diffuse(3)])  # the same shapes: its own kinds, held to the budget
        with lib_attn.recording() as rec:
            second(torch.zeros(1))
    assert len(sparse_plan._kinds) == 4
    assert rec.sparse.calls == 0 and sum(rec.sparse.dense.values()) == 2
    assert max(e for block in first.blocks for e in block.errors) <= BUDGET


def test_a_module_that_goes_drops_its_kinds():
    model = Model([local(0)])
    model(torch.zeros(1))
    assert len(sparse_plan._kinds) == 1
    del model
    gc.collect()
    Model([local(1)])(torch.zeros(1))  # a new kind: the old one's are dropped with it
    assert len(sparse_plan._kinds) == 1


def test_measured_calls_follow_no_period_and_no_long_gap():
    # which calls of a kind are measured: one in each run of RECHECK_EVERY, at a random place
    kind = sparse_plan.Kind()
    every = sparse_plan.RECHECK_EVERY
    hits = [kind.measured_now() for _ in range(4000)]
    assert sum(hits) == 1000
    for phase in range(every):  # every phase of a period of RECHECK_EVERY (or 2) is measured about as often
        assert 200 <= sum(hits[phase::every]) <= 300
    for phase in range(2):
        assert 450 <= sum(hits[phase::2]) <= 550
    gaps, last = [], -1
    for i, hit in enumerate(hits):
        if hit:
            gaps.append(i - last - 1)
            last = i
    assert max(gaps) <= 2 * every - 2


def test_measured_rows_change_and_cover_every_query_block():
    q = torch.zeros(2, 40, 9450, 8)  # Wan's CFG-batched 40 heads: more pairs than one measurement takes
    rng = random.Random(0)
    seen_blocks, seen_pairs, first = set(), set(), None
    for _ in range(20):
        s = measure.draw(q, "bhsd", rng)
        assert s.rows.shape == (64, 8) and len(s.batch) == 64
        if first is None:
            first = s.rows.clone()
        seen_pairs.update(zip(s.batch.tolist(), s.head.tolist()))
        seen_blocks.update((s.rows // 128).flatten().tolist())
    assert not torch.equal(first, s.rows)
    assert seen_blocks == set(range(-(-9450 // 128))) and len(seen_pairs) == 80


def test_measured_error_is_float64s_on_the_drawn_rows():
    q, k, v = local(3)
    out = lib_attn.attention(q, k, v, role="dit", backend="sdpa") * 1.01
    s = measure.draw(q, "bhsd", random.Random(5))
    exact = reference(q, k, v)
    rows = s.rows[0]
    expected = rel_err(out[0, 0, rows], exact[0, 0, rows])
    assert measure.output_error(out, q, k, v, None, "bhsd", s) == pytest.approx(expected, rel=1e-4)


def test_the_model_a_call_comes_from_is_found_in_any_file_outside_the_engine():
    """Only the engine's own frames are passed over: a model defined beside it (a host adapter of this
    package, these tests) is the caller, whether or not torch's ``Module.__call__`` frame is on the stack."""
    class Beside(torch.nn.Module):
        def forward(self):
            return sparse_plan.caller_module()

    model = Beside()
    assert Beside.forward(model) is model    # no torch frame between
    assert model() is model


def _float64_routed_error(q, k, v, scale, routing, samples) -> float:
    """The relative L2 error on the drawn rows of attention over ``routing``'s blocks (with its pooled term
    when it has one) against exact attention, all in float64."""
    from tests.test_block_sparse import pooled_reference, routed_mask
    n, kv = q.shape[2], k.shape[2]
    exact = reference(q, k, v, scale=scale)
    got = (pooled_reference(q, k, v, scale, routing) if routing.pooled
           else reference(q, k, v, mask=routed_mask(routing, n, kv, routing.block), scale=scale))
    diff = norm = 0.0
    for i, (b, h) in enumerate(zip(samples.batch.tolist(), samples.head.tolist())):
        rows = samples.rows[i]
        diff += float((got[b, h, rows] - exact[b, h, rows]).square().sum())
        norm += float(exact[b, h, rows].square().sum())
    return (diff / norm) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "routed-only"])
def test_every_setting_of_a_ladder_is_measured_as_float64_attention_over_its_blocks(dtype, pooled, monkeypatch):
    # a ragged last key block (700 tokens in blocks of 64), values cast two blocks at a time (the last
    # group one block, part-filled) and rows scored a few at a time: every path of the block split
    from lib_attn.kernels.block_sparse.routing import route
    monkeypatch.setattr(measure, "KEY_STEP", 128)
    monkeypatch.setattr(measure, "ROW_BYTES", 24 * 700 * 4)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 700, 16, generator=gen).to(dtype) for _ in range(3))
    scale = 0.4
    routings = [route(q.float(), k.float(), scale, 64, "topk", t, pooled_rest=pooled) for t in (0.1, 0.3, 0.6)]
    samples = measure.draw(q, "bhsd", random.Random(4), rows=300)
    got = measure.routed_errors(q, k, v, scale, "bhsd", routings, samples)
    expected = [_float64_routed_error(q, k, v, scale, r, samples) for r in routings]
    assert got[0] > got[1] > got[2] > 0
    assert got == pytest.approx(expected, rel=1e-4)  # fp32 arithmetic on the inputs' own values


def test_a_setting_that_leaves_out_a_rows_largest_scores_is_measured_without_overflow():
    # sharp attention (scores spanning hundreds): a row's largest score can sit in a block it does not keep,
    # so no one shift of the exponent suits every setting
    from lib_attn.kernels.block_sparse.routing import route
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 512, 16, generator=gen) for _ in range(3))
    scale = 12.0
    routings = [route(q, k, scale, 64, "topk", t, pooled_rest=p) for t in (0.125, 0.5) for p in (True, False)]
    samples = measure.draw(q, "bhsd", random.Random(6), rows=256)
    got = measure.routed_errors(q, k, v, scale, "bhsd", routings, samples)
    expected = [_float64_routed_error(q, k, v, scale, r, samples) for r in routings]
    assert all(map(math.isfinite, got)) and got == pytest.approx(expected, rel=1e-4)


def _peak_bytes(fn) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn`` ran, over what it held before."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for event in prof.profiler.kineto_results.events():
        if event.name() == "[memory]":  # one allocation (bytes > 0) or release (< 0), in the order made
            now += event.nbytes()
            peak = max(peak, now)
    return peak


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 128), (torch.float16, 256)])
def test_measuring_a_ladder_holds_one_chunk_of_rows_scores_twice_and_their_values_per_block(dtype, head_dim):
    # three chunks of rows: a chunk's scores and block sums are gone before the next chunk's scores are
    # made, and the values per block are laid out once (at head dim 256 they are twice the scores)
    from lib_attn.kernels.block_sparse.routing import route
    n, block = 8192, 128
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 1, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    routings = [route(q.float(), k.float(), head_dim ** -0.5, block, "topk", t, pooled_rest=True) for t in (0.1, 0.3)]
    rows = measure.ROW_BYTES // (n * 4)
    samples = measure.draw(q, "bhsd", random.Random(3), rows=3 * rows)
    peak = _peak_bytes(lambda: measure.routed_errors(q, k, v, None, "bhsd", routings, samples))
    scores = rows * n * 4
    weighted = scores * head_dim // block
    # a group of KEY_STEP keys at a time: its keys and values cast (half inputs), its rows' weighted values
    group = 2 * measure.KEY_STEP * head_dim * 4 + rows * measure.KEY_STEP // block * head_dim * 4
    assert peak <= 2 * scores + weighted + group + 2**20, f"{peak / 2**20:.1f} MiB"


def test_calibration_measures_its_ladder_on_more_rows_than_a_later_check():
    seen = []
    real_draw = measure.draw

    def draw(q, layout, rng, rows=None):
        samples = real_draw(q, layout, rng, rows)
        seen.append(samples.rows.numel())
        return samples

    q, k, v = local_inputs(1, 2, (4, 32, 32), 32, torch.float32, CPU, seed=5, strength=1.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "draw", draw)
        lib_attn.configure(sparse={"method": "block-sparse", "min_tokens": 1024, "dense": "none", "budget": 0.5})
        with lib_attn.recording() as rec:
            for _ in range(2 * sparse_plan.RECHECK_EVERY):
                lib_attn.attention(q, k, v, role="dit")
    assert rec.sparse.calls == 2 * sparse_plan.RECHECK_EVERY and not rec.sparse.dense
    assert seen[0] == measure.CALIBRATION_ROWS and len(seen) >= 2            # 2 heads of 4,096 rows: 2,048 each
    assert set(seen[1:]) == {lib_attn.check.SAMPLES}                         # the later measured calls


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_calibration_routes_only_the_pairs_it_drew_one_at_a_time(layout, monkeypatch):
    # Wan's CFG-batched call has 80 (batch item, head) pairs, more than a measurement draws: each drawn
    # pair is routed alone, when its rows are measured, and the errors are those of the whole call's routings
    kernel = BlockSparse()
    seen = []
    whole = kernel.routings
    monkeypatch.setattr(BlockSparse, "routings", lambda self, q, k, scale, knobs: seen.append(q.shape[:2]) or
                        whole(q, k, scale, knobs))
    gen = torch.Generator().manual_seed(13)
    shape = (2, 1024, 40, 16) if layout == "bshd" else (2, 40, 1024, 16)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit", layout=layout)
    assert rec.sparse.dense and seen == [(1, 1)] * 64  # calibrated (random inputs: over the budget)
    seen.clear()
    plan = _routing_plan(kernel, layout)
    ladder = kernel.ladder(lib_attn.Knob("topk", 0.1))
    samples = measure.draw(q, layout, random.Random(8), measure.CALIBRATION_ROWS)
    by_pair = measure.routed_errors(q, k, v, None, layout, plan._pair_routings(ladder, q, k, None), samples)
    assert seen == [(1, 1)] * 64 and len(samples.batch) == 64
    as_whole = measure.routed_errors(q, k, v, None, layout, plan._routings(ladder, q, k, None), samples)
    assert by_pair == pytest.approx(as_whole, rel=1e-6)


def _routing_plan(kernel, layout: str, cast=None):
    """A plan of calls in ``layout`` on ``kernel`` (computing in ``cast``), as far as routing reads it."""
    plan = sparse_plan.Plan.__new__(sparse_plan.Plan)
    plan.kernel, plan.cast = kernel, cast
    plan.spec = type("S", (), {"layout": layout})()
    return plan


def _packed(qkv, layout: str):
    """q, k, v as the strided views of one (b, n, 3, h, d) buffer that Flux's attention passes, in ``layout``."""
    b, h, n, d = qkv[0].shape
    packed = torch.empty(b, n, 3, h, d)
    for i, t in enumerate(qkv):
        packed[:, :, i] = t.transpose(1, 2)
    return tuple(packed[:, :, i] if layout == "bshd" else packed[:, :, i].transpose(1, 2) for i in range(3))


@pytest.mark.parametrize("text", [None, "first", "last"])
@pytest.mark.parametrize("knob", [lib_attn.Knob("topk", 0.1), lib_attn.Knob("threshold", 0.8)], ids=str)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("b, heads, grid, cast", [(2, 3, (5, 12, 20), None), (3, 2, (4, 16, 16), torch.bfloat16)],
                         ids=["ragged", "cast"])
def test_each_pair_routed_alone_keeps_the_blocks_the_whole_call_routes_it(b, heads, grid, cast, layout, knob, text):
    # one routing per pair against the whole call's: ragged last blocks (1,200 tokens), a cast, the diagonal,
    # q, k, v strided views of one packed buffer in either layout, and a joint call's text blocks (told
    # for a call of exactly that many tokens) at either end
    kernel = BlockSparse()
    q, k, v = _packed(local_inputs(b, heads, grid, 16, torch.float32, CPU, seed=17, strength=1.0), layout)
    n = q.shape[1 if layout == "bshd" else 2]
    plan = _routing_plan(kernel, layout, cast)
    ladder = kernel.ladder(knob)
    samples = measure.draw(q, layout, random.Random(9), rows=600)
    told = conditioning.text(40, n, text) if text else contextlib.nullcontext()
    with told:
        whole = plan._routings(ladder, q, k, None)
        of = plan._pair_routings(ladder, q, k, None)
        by_pair = measure.routed_errors(q, k, v, None, layout, of, samples)
        as_whole = measure.routed_errors(q, k, v, None, layout, whole, samples)
        for i, (bi, hi) in enumerate(zip(samples.batch.tolist(), samples.head.tolist())):
            rows = samples.rows[i]
            for alone, routing in zip(of(bi, hi), whole):
                assert torch.equal(alone.kept_blocks(0, 0, rows), routing.kept_blocks(bi, hi, rows))
                assert alone.exact_rows == routing.exact_rows and (routing.exact_rows is not None) == bool(text)
    assert len(set(by_pair)) > 1 and by_pair == pytest.approx(as_whole, rel=1e-12)


def test_each_pair_is_routed_as_the_kernel_routes_under_the_hosts_autocast():
    # the hosts run attention under autocast, whose matmuls give the kernel's pooled scores in half
    # precision: the ladder is measured on those routings, not on ones made with autocast off
    kernel = BlockSparse()
    q, k, v = local_inputs(2, 3, (4, 16, 32), 32, torch.float32, CPU, seed=1, strength=1.0)
    plan = _routing_plan(kernel, "bhsd")
    ladder = kernel.ladder(lib_attn.Knob("topk", 0.1))
    samples = measure.draw(q, "bhsd", random.Random(3), rows=2048)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run = [kernel.routing(q, k, None, knob) for knob in ladder]  # as ``run_sparse`` routes the call
        by_pair = measure.routed_errors(q, k, v, None, "bhsd", plan._pair_routings(ladder, q, k, None), samples)
    as_run = measure.routed_errors(q, k, v, None, "bhsd", run, samples)
    assert by_pair == pytest.approx(as_run, rel=1e-12)
