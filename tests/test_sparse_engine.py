"""Sparse attention in the engine: which calls go sparse, the error budget measured per call kind against
exact attention (float64 here), calibration, over-budget kinds and faults running dense with their reasons,
dense windows, and the readout."""
from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import check
from lib_attn import schedule as sched
from lib_attn.commands.bench.inputs import local_inputs
from lib_attn.kernels import REGISTRY
from lib_attn.report import Report
from lib_attn import sparse_measure as measure
from lib_attn import sparse_plan
from tests.engine_helpers import reference, rel_err

CPU = torch.device("cpu")
GRID = (4, 16, 32)  # 2,048 tokens: frames x height x width
N = 4 * 16 * 32


@pytest.fixture(autouse=True)
def fresh():
    lib_attn.reset()
    sparse_plan.seed(0)
    yield
    lib_attn.reset()
    sched.leave()


def local(seed=0, dtype=torch.float32, heads=2):
    return local_inputs(1, heads, GRID, 32, dtype, CPU, seed=seed, strength=1.0)


def diffuse(seed=0, n=N, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, n, 32, generator=gen).to(dtype) for _ in range(3))


def sampled_error64(out, q, k, v, s=None) -> float:
    """The error the readout should report: out on the rows ``s`` (default: the guard's) against float64."""
    s = s if s is not None else check.samples(q, "bhsd")
    ref = reference(q, k, v)
    rows = s.rows if s.rows.dim() == 2 else s.rows[None, :].expand(len(s.batch), -1)
    pick = (s.batch[:, None], s.head[:, None], rows)
    return rel_err(out[pick], ref[pick])


@pytest.fixture
def drawn(monkeypatch):
    """The rows each measurement drew, in order."""
    found = []
    original = measure.draw

    def draw(*args):
        found.append(original(*args))
        return found[-1]

    monkeypatch.setattr(measure, "draw", draw)
    return found


def on(**fields):
    settings = {"method": "block-sparse", "min_tokens": 1024, "dense": "none", **fields}
    lib_attn.configure(sparse=settings)


def test_local_attention_goes_sparse_and_the_reported_error_is_float64s(drawn):
    on(budget=0.15)
    q, k, v = local()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
    sparse = rec.sparse
    assert rec.calls == {("dit", "block-sparse"): 1} and sparse.calls == 1 and sparse.dense_calls == 0
    (role, backend, kind, setting), = sparse.kinds
    assert (role, backend, kind) == ("dit", "block-sparse", "any")
    measured = sparse.error_max()
    rows, = drawn
    assert measured <= 0.15 and measured == pytest.approx(sampled_error64(out, q, k, v, rows), rel=1e-3, abs=1e-5)
    assert measured == pytest.approx(rel_err(out, reference(q, k, v)), rel=0.5)  # the sample stands for the call
    # calibration chose the sparsest setting within the budget (its 95% bound): the next sparser one is over it
    ladder = REGISTRY["block-sparse"].ladder(lib_attn.Knob("topk", 0.2))
    chosen = next(i for i, knob in enumerate(ladder) if knob.text == setting)
    assert 0.0 < sparse.kept_share() <= ladder[chosen].value + 2 / 16 + 1e-6
    if chosen > 0:
        sparser = REGISTRY["block-sparse"].routing(q, k, None, ladder[chosen - 1])
        assert measure.routed_errors(q, k, v, None, "bhsd", [sparser], rows, bound=True)[0] > 0.15


def test_calibration_starts_at_the_users_topk():
    on(budget=0.15, topk=0.05)
    q, k, v = local()
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit")
    (_, _, _, setting), = rec.sparse.kinds
    on(budget=1.0, topk=0.05)
    with lib_attn.recording() as loose:
        lib_attn.attention(q, k, v, role="dit")
    assert [key[3] for key in loose.sparse.kinds] == ["topk 0.05"]  # anything is within a budget of 1
    assert float(setting.split()[1]) >= 0.05


def test_diffuse_attention_goes_dense_over_budget_with_the_dense_output():
    on(budget=0.15)
    q, k, v = diffuse()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
        again = lib_attn.attention(q, k, v, role="dit")
    sparse = rec.sparse
    assert rec.calls == {("dit", "sdpa"): 2} and sparse.calls == 0
    (role, reason), = sparse.dense
    assert role == "dit" and sparse.dense[(role, reason)] == 2
    assert reason.startswith("over budget: ") and reason.endswith(" > 0.15")
    assert float(reason.split()[2]) > 0.15
    dense = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, dense) and torch.equal(again, dense)


def test_with_calibration_off_the_given_setting_is_held_to_the_budget():
    on(budget=0.15, topk=0.05, calibrate=False)
    q, k, v = local()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
    assert rec.sparse.calls == 0 and list(rec.sparse.dense)[0][1].startswith("over budget")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("call, reason", [
    (lambda q, k, v: (q, k[:, :, :77], v[:, :, :77], {}), "cross-attention"),
    (lambda q, k, v: (q[:, :, :1000], k[:, :, :1000], v[:, :, :1000], {}), "below min_tokens: 1000 < 1024"),
    (lambda q, k, v: (q, k, v, {"mask": torch.ones(N, N, dtype=torch.bool)}), "dense mask"),
    (lambda q, k, v: (q, k, v, {"role": "vae"}), "vae calls stay dense"),
])
def test_ineligible_calls_stay_dense_with_their_reason(call, reason):
    on()
    q, k, v, extra = call(*local())
    extra.setdefault("role", "dit")
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, **extra)
        lib_attn.attention(q, k, v, **extra)
    assert rec.sparse.dense == {(extra["role"], reason): 2} and rec.sparse.calls == 0
    with lib_attn.use(sparse="off"):
        assert torch.equal(out, lib_attn.attention(q, k, v, **extra))


def test_dense_windows_run_the_dense_configuration():
    lib_attn.configure(sparse="block-sparse, min_tokens=1024", preference=["math"])
    q, k, v = local()
    with lib_attn.recording() as rec:
        sched.at_step(0, 10)
        sched.at_block(3, 8)
        lib_attn.attention(q, k, v, role="dit")     # 0-20%
        sched.at_step(5, 10)
        sched.at_block(0, 8)
        lib_attn.attention(q, k, v, role="dit")     # first 1
        sched.at_block(4, 8)
        lib_attn.attention(q, k, v, role="dit")     # sparse
    assert rec.sparse.dense == {("dit", "dense window: 0-20%"): 1, ("dit", "dense window: first 1"): 1}
    assert rec.calls == {("dit", "math"): 2, ("dit", "block-sparse"): 1}  # the windows ran the configured chain
    assert [key[2] for key in rec.sparse.kinds] == ["block 4, 40-60%"]


def test_each_block_and_band_is_a_kind_of_its_own():
    on(budget=0.15)
    local_qkv, random_qkv = local(), diffuse()
    with lib_attn.recording() as rec:
        sched.at_step(5, 10)
        sched.at_block(1, 4)
        lib_attn.attention(*local_qkv, role="dit")
        sched.at_block(2, 4)
        lib_attn.attention(*random_qkv, role="dit")   # same shape, another block: calibrated on its own
        sched.at_step(9, 10)
        sched.at_block(1, 4)
        lib_attn.attention(*local_qkv, role="dit")
    assert set(key[2] for key in rec.sparse.kinds) == {"block 1, 40-60%", "block 1, 80-100%"}
    assert [reason.split(":")[0] for (_, reason) in rec.sparse.dense] == ["over budget"]


def test_a_kind_whose_inputs_turn_diffuse_is_caught_at_a_measured_call_and_recalibrated_there():
    on(budget=0.15)
    q, k, v = local()
    rq, rk, rv = diffuse()
    dense = F.scaled_dot_product_attention(rq, rk, rv)
    outs = []
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit")
        for _ in range(2 * sparse_plan.RECHECK_EVERY - 1):  # a measurement falls in these, wherever drawn
            outs.append(lib_attn.attention(rq, rk, rv, role="dit"))
    caught = next(i for i, out in enumerate(outs) if torch.equal(out, dense))
    assert caught <= 2 * sparse_plan.RECHECK_EVERY - 2
    assert all(torch.equal(out, dense) for out in outs[caught:])  # recalibrated on that call: over budget, dense
    over = [n for (_, reason), n in rec.sparse.dense.items() if reason.startswith("over budget")]
    assert sum(over) == len(outs) - caught
    # the readout's errors are those of returned outputs; the one over the budget is counted apart
    assert rec.sparse.measured == 1 and rec.sparse.error_max() <= 0.15
    assert rec.sparse.replaced_calls == 1 and rec.sparse.replaced_error_max() > 0.15
    data = Report.from_recording(rec).to_dict()["sparse"]
    assert data["replaced"] == 1 and data["replaced_error_max"] > 0.15 and data["error_max"] <= 0.15


class Faulty(lib_attn.SparseBackend):
    id = "faulty-sparse"
    label = "test: a sparse kernel with a fault"
    dtypes = (torch.float32,)
    fault = "nan"

    def run_sparse(self, q, k, v, scale, knob):
        if self.fault == "write":
            k.mul_(1.0001)
        out = F.scaled_dot_product_attention(q, k, v)
        if self.fault == "nan":
            out[0, 0, 5] = float("nan")
        return lib_attn.SparseResult(out, None, knob.value)


@pytest.mark.parametrize("fault, what", [("nan", "non-finite values"), ("write", "wrote into its inputs")])
def test_faults_are_caught_counted_and_recomputed_dense(fault, what):
    backend = Faulty()
    backend.fault = fault
    lib_attn.register_backend(backend)
    try:
        lib_attn.configure(sparse="faulty-sparse, min_tokens=1024, dense=none, calibrate=off")
        q, k, v = local()
        k_before = k.clone()
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v, role="dit")
            lib_attn.attention(q, k, v, role="dit")
        assert torch.equal(k, k_before)  # the probe ran on copies: the caller's tensors were never touched
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
        assert rec.sparse.calls == 0
        assert rec.sparse.dense == {("dit", f"faulty-sparse {what}"): 2}
        assert [(key[1], key[2], key[3]) for key in rec.guard] == [("faulty-sparse", what, "dense")]
    finally:
        lib_attn.reset()
        lib_attn.unregister_backend("faulty-sparse")


class Opaque(lib_attn.SparseBackend):
    """block-sparse's kernel without a stated routing, so the engine must run it to calibrate; records each knob."""
    id = "opaque-sparse"
    label = "test: block-sparse without a stated routing"
    dtypes = (torch.float32,)

    def __init__(self):
        self.runs: list = []

    def run_sparse(self, q, k, v, scale, knob):
        self.runs.append(knob.text)
        return REGISTRY["block-sparse"].run_sparse(q, k, v, scale, knob)


def test_a_backend_without_routing_is_calibrated_by_running_it(drawn, monkeypatch):
    backend = Opaque()
    lib_attn.register_backend(backend)
    passes = []
    scored_rows = measure._scored_rows
    monkeypatch.setattr(measure, "_scored_rows", lambda *a: passes.append(1) or scored_rows(*a))
    try:
        lib_attn.configure(sparse="opaque-sparse, min_tokens=1024, dense=none, topk=0.05, budget=0.15")
        q, k, v = local()
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v, role="dit")
        (_, _, _, setting), = rec.sparse.kinds
        # the probe's run, then the ladder from 0.05 up to the first setting within the budget, each
        # output measured once (the one returned is not measured again)
        assert backend.runs[0] == "topk 0.05" and backend.runs[-1] == setting
        assert len(backend.runs) > 2 and len(passes) == len(backend.runs) - 1
        assert rec.sparse.error_max() == pytest.approx(sampled_error64(out, q, k, v, drawn[-1]), rel=1e-3)
        assert rec.sparse.error_max() <= 0.15
    finally:
        lib_attn.reset()
        lib_attn.unregister_backend("opaque-sparse")


class Unstated(Opaque):
    """block-sparse's kernel with a ``routing`` that states none for these calls (its contract: None where
    the output is not exact attention over routed blocks), so the engine must run it to calibrate."""
    id = "unstated-sparse"
    label = "test: block-sparse stating no routing for a call"

    def routing(self, q, k, scale, knob):
        return None


def test_a_backend_whose_routing_states_none_for_a_call_is_calibrated_by_running_it(drawn):
    backend = Unstated()
    lib_attn.register_backend(backend)
    try:
        lib_attn.configure(sparse="unstated-sparse, min_tokens=1024, dense=none, topk=0.05, budget=0.15")
        q, k, v = local()
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v, role="dit")
        (_, _, _, setting), = rec.sparse.kinds
        assert backend.states_routing and backend.runs[0] == "topk 0.05" and backend.runs[-1] == setting
        assert len(backend.runs) > 2 and rec.sparse.error_max() <= 0.15
        assert rec.sparse.error_max() == pytest.approx(sampled_error64(out, q, k, v, drawn[-1]), rel=1e-3)
    finally:
        lib_attn.reset()
        lib_attn.unregister_backend("unstated-sparse")


def test_the_report_carries_the_readout_and_reads_it_back(monkeypatch):
    monkeypatch.setattr(sparse_plan.Kind, "measured_now", lambda self: False)  # only calibrations measure
    on(budget=0.15)
    with lib_attn.recording() as rec:
        lib_attn.attention(*local(), role="dit")
        lib_attn.attention(*diffuse(1, n=N // 2), role="dit")
        lib_attn.attention(*diffuse(1, n=N // 2), role="dit")
        lib_attn.attention(*local(), role="dit")
    report = Report.from_recording(rec)
    data = report.to_dict()["sparse"]
    assert data["settings"] == lib_attn.config().sparse.text and data["budget"] == 0.15
    assert data["calls"] == 2 and data["measured"] == 1
    assert data["error_max"] == data["error_typical"] <= 0.15
    assert [d["reason"].split(":")[0] for d in data["dense"]] == ["over budget"]
    assert data["seconds"]["sparse"] > 0 and data["seconds"]["dense"] > 0 and data["seconds"]["calibration"] > 0
    back = Report.from_dict(report.to_dict())
    assert back.to_dict() == report.to_dict()
    assert (back.sparse.kinds, back.sparse.dense, back.sparse.errors) == \
        (report.sparse.kinds, report.sparse.dense, report.sparse.errors)
    assert lib_attn.sparse.parse(back.sparse.settings) == lib_attn.config().sparse  # paste-back restores it
    with lib_attn.use(sparse="off"), lib_attn.recording() as off:
        lib_attn.attention(*local(), role="dit")
    assert off.sparse is None and "sparse" not in Report.from_recording(off).to_dict()


def test_half_inputs_are_measured_against_exact_attention(drawn):
    on(budget=0.2)
    q, k, v = local(dtype=torch.bfloat16)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
    assert out.dtype == torch.bfloat16 and rec.sparse.calls == 1
    assert rec.sparse.error_max() == pytest.approx(sampled_error64(out, q, k, v, drawn[-1]), rel=1e-2)
    assert not math.isnan(rec.sparse.kept_share())


def _poisoned(q, k, v):
    """v with one key's values NaN: exact attention is NaN on every row, so no error can be measured."""
    v = v.clone()
    v[:, :, 7] = float("nan")
    return q, k, v


def test_a_kind_whose_first_call_cannot_be_measured_runs_it_dense_and_calibrates_on_the_next(drawn):
    on(budget=0.15, topk=0.05)
    q, k, v = local()
    with lib_attn.recording() as first:
        lib_attn.attention(*_poisoned(q, k, v), role="dit")
    assert first.sparse.calls == 0 and first.sparse.dense == {("dit", sparse_plan.NOT_MEASURED): 1}
    sparse_plan.seed(7)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
    lib_attn.reset()
    on(budget=0.15, topk=0.05)
    sparse_plan.seed(7)  # the same rows drawn
    with lib_attn.recording() as clean:
        lib_attn.attention(q, k, v, role="dit")
    # the setting no measurement backed was not kept: the next call chose what a clean first call chooses
    assert rec.sparse.measured == 1 and [key[3] for key in rec.sparse.kinds] == [key[3] for key in clean.sparse.kinds]
    assert rec.sparse.error_max() == pytest.approx(sampled_error64(out, q, k, v, drawn[1]), rel=1e-3)
    assert rec.sparse.error_max() <= 0.15


def test_a_check_that_cannot_be_measured_runs_the_call_dense_and_checks_the_next(monkeypatch):
    on(budget=0.15)
    q, k, v = local()
    bad = _poisoned(q, k, v)
    checks = iter([True, False])  # a check falls on the poisoned call; the draw would skip the next
    drawn_now = sparse_plan.Kind.measured_now
    monkeypatch.setattr(sparse_plan.Kind, "measured_now", lambda self: drawn_now(self) if self.due else next(checks))
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit")         # calibrated, measured
        lib_attn.attention(*bad, role="dit")            # checked: nothing measurable
        lib_attn.attention(q, k, v, role="dit")         # so this call is checked
    assert rec.sparse.dense == {("dit", sparse_plan.NOT_MEASURED): 1}
    assert rec.sparse.calls == 2 and rec.sparse.measured == 2


def test_a_backend_without_routing_leaves_an_unmeasurable_kind_uncalibrated():
    lib_attn.register_backend(Opaque())
    try:
        lib_attn.configure(sparse="opaque-sparse, min_tokens=1024, dense=none, topk=0.05, budget=0.15")
        q, k, v = local()
        with lib_attn.recording() as rec:
            lib_attn.attention(*_poisoned(q, k, v), role="dit")
            lib_attn.attention(q, k, v, role="dit")
        assert rec.sparse.dense == {("dit", sparse_plan.NOT_MEASURED): 1}
        assert rec.sparse.calls == 1 and rec.sparse.error_max() <= 0.15
    finally:
        lib_attn.reset()
        lib_attn.unregister_backend("opaque-sparse")


@pytest.mark.parametrize("error, budget", [(0.1500001, 0.15), (0.15004, 0.15), (1.0900, 0.001), (0.2, 0.15),
                                           (0.150000000001, 0.15)])
def test_the_over_budget_reason_shows_the_error_above_the_budget(error, budget):
    reason = sparse_plan.over_budget(error, budget)
    shown, limit = reason.removeprefix("over budget: ").split(" > ")
    assert float(shown) > float(limit) == budget, reason
    assert float(shown) == pytest.approx(error, rel=1e-3)


def test_a_backend_without_routing_gets_no_cast_copies_for_it(monkeypatch):
    # Sol states no routing: calibration runs the kernel, so q and k are not cast to look for one
    made = []
    plan = sparse_plan.Plan.__new__(sparse_plan.Plan)
    plan.kernel, plan.cast = REGISTRY["sol"], torch.float16
    plan.spec = type("S", (), {"layout": "bhsd"})()
    q = torch.randn(1, 2, 256, 128)
    original = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: made.append(a) or original(self, *a, **kw))
    assert plan._routings((lib_attn.Knob("topk", 0.2),), q, q, None) is None
    assert made == [] and not REGISTRY["sol"].states_routing and REGISTRY["block-sparse"].states_routing


def test_calls_whose_position_is_unknown_are_named_with_the_windows_that_did_not_apply():
    # the default windows (the first 20% of steps, the first block) need a step and a block the host tells
    lib_attn.configure(sparse={"method": "block-sparse", "min_tokens": 1024, "budget": 0.5})
    q, k, v = local()
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit")          # no step, no block
        sched.at_step(5, 10)
        lib_attn.attention(q, k, v, role="dit")          # a step, no block
        sched.at_block(2, 8)
        lib_attn.attention(q, k, v, role="dit")          # both: the windows were applied (and do not hold)
        sched.at_block(0, 8)
        lib_attn.attention(q, k, v, role="dit")          # the first block: dense
    assert [key[2] for key in rec.sparse.kinds] == [
        "any; position unknown: dense window 0-20%, first 1 not applied",
        "40-60%; position unknown: dense window first 1 not applied",
        "block 2, 40-60%"]
    assert rec.sparse.dense == {("dit", "dense window: first 1"): 1}
    on(budget=0.5)                                       # dense=none: no window to apply
    with lib_attn.recording() as rec:
        sched.leave()
        lib_attn.attention(q, k, v, role="dit")
    assert [key[2] for key in rec.sparse.kinds] == ["any"]


class Gated(Opaque):
    """A backend without routing whose runs wait on ``release`` once ``gate`` is set (a slow calibration),
    or that runs out of memory on the runs ``oom`` lists."""
    id = "gated-sparse"

    def __init__(self):
        super().__init__()
        self.gate, self.started, self.release = False, threading.Event(), threading.Event()
        self.oom: set = set()

    def run_sparse(self, q, k, v, scale, knob):
        if len(self.runs) in self.oom:
            self.runs.append("oom")
            raise RuntimeError("CUDA out of memory. Tried to allocate 6.00 GiB")
        if self.gate:
            self.started.set()
            assert self.release.wait(60)
        return super().run_sparse(q, k, v, scale, knob)


@pytest.fixture
def gated():
    backend = Gated()
    lib_attn.register_backend(backend)
    lib_attn.configure(sparse="gated-sparse, min_tokens=1024, dense=none, topk=0.3, budget=0.3")
    yield backend
    lib_attn.reset()
    lib_attn.unregister_backend("gated-sparse")


def test_a_kind_being_calibrated_in_another_thread_runs_dense_under_that_reason(gated):
    q, k, v = local()
    gated.gate = True
    first = threading.Thread(target=lambda: lib_attn.attention(q, k, v, role="dit"))
    first.start()
    try:
        assert gated.started.wait(60)
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v, role="dit")
    finally:
        gated.release.set()
        first.join(60)
    assert rec.sparse.dense == {("dit", sparse_plan.CALIBRATING): 1}
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    gated.gate = False
    with lib_attn.recording() as after:
        lib_attn.attention(q, k, v, role="dit")
    assert after.sparse.calls == 1  # calibrated by the first thread


def test_out_of_memory_in_a_sparse_run_is_one_dense_call(gated):
    q, k, v = local()
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, role="dit")     # the probe's run and calibration's
        gated.oom.add(len(gated.runs))
        out = lib_attn.attention(q, k, v, role="dit")
        lib_attn.attention(q, k, v, role="dit")
    assert "oom" in gated.runs
    assert rec.sparse.dense == {("dit", sparse_plan.OUT_OF_MEMORY): 1} and rec.sparse.calls == 2
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and rec.guard == {}


def test_sol_named_without_a_setting_runs_tau_1_3():
    settings = lib_attn.sparse.make("sol")
    assert settings.knob == lib_attn.Knob("threshold", 1.3) and "threshold=1.3" in settings.text
    assert lib_attn.sparse.make("block-sparse").knob == lib_attn.Knob("topk", 0.1)
    assert lib_attn.sparse.make("sol", topk=0.2).knob == lib_attn.Knob("topk", 0.2)
