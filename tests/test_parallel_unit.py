"""``lib_attn.parallel`` in one process: the sharding convention, the degrees, the log-sum-exp forms of
the local kernels and their check, the communication formulas, the readout's JSON, bad input, and
the ``parallel`` command (which starts its own ranks)."""
import json
import os

import pytest
import torch

import lib_attn
from lib_attn import parallel
from lib_attn.commands import cli
from lib_attn.parallel import local, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ref(q, k, v, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def test_the_sharding_convention_splits_anything():
    assert parallel.sizes(10, 4) == [3, 3, 2, 2]
    assert parallel.sizes(3, 4) == [1, 1, 1, 0]
    assert [parallel.bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    x = torch.arange(10)
    assert torch.equal(torch.cat([parallel.shard(x, 0, 4, r) for r in range(4)]), x)
    with pytest.raises(ValueError, match="cannot split 5 tokens over 0 ranks"):
        parallel.sizes(5, 0)


def test_degrees_fill_in_and_name_the_valid_ones():
    assert parallel.degrees(8, None, None) == (8, 1)
    assert parallel.degrees(8, 4, None) == (4, 2)
    assert parallel.degrees(8, None, 8) == (1, 8)
    with pytest.raises(ValueError, match=r"ulysses=3, ring=2.*valid \(ulysses x ring\): 1x8, 2x4, 4x2, 8x1"):
        parallel.degrees(8, 3, 2)
    with pytest.raises(ValueError, match="ring degree 0 must be a positive integer"):
        parallel.degrees(8, None, 0)


def test_a_configuration_needs_torch_distributed_initialised():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is open in this process")
    with pytest.raises(parallel.ParallelError, match="init_process_group"):
        parallel.Parallel(ulysses=2)


def test_without_a_configuration_a_call_is_the_engines():
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    assert parallel.current() is None
    assert torch.equal(parallel.attention(q, k, v), lib_attn.attention(q, k, v, role="dit"))


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "both"}, "kind 'both' is not one of self, cross, joint"),
    ({"kind": "self", "text_len": 3}, "text_len 3 is for kind 'joint' only"),
    ({"kind": "joint", "text_len": -1}, "text_len -1 must be an integer >= 0"),
    ({"layout": "bhds"}, "layout 'bhds' is not one of bhsd, bshd"),
    ({"role": "image"}, "role 'image' is not one of"),
])
def test_bad_input_names_the_value_and_the_valid_ones(kwargs, message):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=message):
        parallel.attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match="must be a lib_attn.parallel.Parallel"):
        parallel.configure("ring")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("runner", ["math", "sdpa-flash", "sdpa"])
def test_the_cpu_lse_forms_agree_with_float64(runner, dtype):
    q, k, v = (torch.randn(2, 3, n, 16, dtype=dtype) for n in (13, 21, 21))
    scale = 16 ** -0.5
    out, lse = local.RUNNERS[runner](q, k, v, scale)
    want_out, want_lse = _ref(q, k, v, scale)
    assert lse.shape == (2, 3, 13)
    bound = 100 * torch.finfo(dtype).eps
    assert float((lse.double() - want_lse).abs().max()) <= bound * float(want_lse.abs().max())
    assert float(torch.linalg.vector_norm(out.double() - want_out) / torch.linalg.vector_norm(want_out)) <= bound
    assert local.lse_check(out, lse, q, k, v, scale, dtype) == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_math_lse_in_many_chunks_agrees_with_float64(monkeypatch, dtype):
    # A chunk budget of 5 query rows (as a long call gets at its real budget): the blocks are joined right.
    q, k, v = (torch.randn(2, 3, n, 16, dtype=dtype) * 3 for n in (23, 31, 31))
    monkeypatch.setattr(local, "LSE_CHUNK_BYTES", 5 * 2 * 3 * 31 * torch.finfo(dtype).bits // 8)
    out, lse = local.math_lse(q, k, v, 0.25)
    want_out, want_lse = _ref(q, k, v, 0.25)
    bound = 100 * torch.finfo(dtype).eps
    assert out.dtype == dtype and lse.shape == (2, 3, 23)
    assert float((lse.double() - want_lse).abs().max()) <= bound * float(want_lse.abs().max())
    assert float(torch.linalg.vector_norm(out.double() - want_out) / torch.linalg.vector_norm(want_out)) <= bound


def test_the_lse_check_catches_zero_shifted_and_misshapen_lse_and_a_wrong_output():
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) * 3 for _ in range(3))
    out, lse = local.math_lse(q, k, v, 8 ** -0.5)
    assert local.lse_check(out, lse, q, k, v, 8 ** -0.5, torch.float64) == ""
    assert local.lse_check(out, torch.zeros_like(lse), q, k, v, 8 ** -0.5, torch.float64) == "log-sum-exp is all zero"
    assert local.lse_check(out, lse + 0.01, q, k, v, 8 ** -0.5, torch.float64).startswith("log-sum-exp off by")
    assert "expected (1, 2, 40)" in local.lse_check(out, lse[..., None], q, k, v, 8 ** -0.5, torch.float64)
    assert local.lse_check(out * 1.01, lse, q, k, v, 8 ** -0.5, torch.float64).startswith("output off by")


def test_a_ring_step_runs_the_engines_choice_or_falls_back_to_one_with_an_lse():
    lib_attn.reset()
    local.reset()
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    try:
        with lib_attn.recording() as rec:
            local.attention_lse(q, k, v, 8 ** -0.5, "dit")
        assert dict(rec.calls) == {("dit", "sdpa"): 1} and not rec.fallbacks
        with lib_attn.use(preference=["sdpa-math"]), lib_attn.recording() as rec:
            out, lse = local.attention_lse(q, k, v, 8 ** -0.5, "dit")
        assert dict(rec.fallbacks) == {("dit", "sdpa-math", local.NO_LSE): 1}
        assert sum(rec.calls.values()) == 1 and ("dit", "sdpa-math") not in rec.calls
        assert local.lse_check(out, lse, q, k, v, 8 ** -0.5, torch.float32) == ""
    finally:
        lib_attn.reset()
        local.reset()


def test_a_kernel_that_keeps_failing_sits_out_twice_as_long_each_time(monkeypatch):
    lib_attn.reset()
    local.reset()
    tries = []

    def always_fails(q, k, v, scale):
        tries.append(1)
        raise RuntimeError("CUDA out of memory (injected)")
    monkeypatch.setitem(local.RUNNERS, "sdpa", always_fails)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    try:
        # Tried at the first step, after sitting out RETRY_AFTER steps, after twice that: the third try is
        # the last step here, and one step fewer leaves it out.
        steps = 1 + local.RETRY_AFTER + 1 + 2 * local.RETRY_AFTER + 1
        with lib_attn.recording() as rec:
            outs = [local.attention_lse(q, k, v, 8 ** -0.5, "dit") for _ in range(steps - 1)]
        assert len(tries) == 2
        with lib_attn.recording() as last:
            outs.append(local.attention_lse(q, k, v, 8 ** -0.5, "dit"))
        assert len(tries) == 3
        assert dict(rec.calls) == {("dit", "math"): steps - 1} and dict(last.calls) == {("dit", "math"): 1}
        assert sum(rec.fallbacks.values()) >= steps - 1
        want, want_lse = _ref(q, k, v, 8 ** -0.5)
        assert all(float((o.double() - want).abs().max()) < 1e-5 for o, _ in outs)
    finally:
        lib_attn.reset()
        local.reset()


def test_the_communication_formulas():
    # Ulysses over 2: q, k, v out and the output back, half of each: 4 x (2 x 2 heads x 4 tokens x 8) x 4 bytes.
    assert plan.call_bytes(2, 4, 8, 8, 4, 2, 2, 1)["total"] == 4 * 2 * 2 * 4 * 8 * 4
    # Ring over 4: keys and values of a quarter of the tokens on each of 3 steps.
    assert plan.call_bytes(1, 4, 64, 8, 2, 4, 1, 4) == {"ulysses": 0, "ring": 2 * 3 * 4 * 16 * 8 * 2,
                                                        "total": 2 * 3 * 4 * 16 * 8 * 2}
    assert plan.call_bytes(1, 4, 64, 8, 2, 4, kind="cross")["total"] == 0
    # A joint ring call adds the all-gather of the text output's rows: 5 rows over 4 ranks, 2 the longest share.
    assert plan.call_bytes(1, 4, 64, 8, 2, 4, 1, 4, text=5, kind="joint")["ring"] == \
        2 * 3 * 4 * 16 * 8 * 2 + 3 * 4 * 2 * 8 * 2
    # Heads that do not divide are padded: 3 heads over ulysses 2 send as 4.
    assert plan.call_bytes(1, 3, 8, 8, 4, 2, 2, 1) == plan.call_bytes(1, 4, 8, 8, 4, 2, 2, 1)


def test_the_report_json_carries_the_parallel_calls():
    key = ("dit", "joint", "ulysses-ring", 8, 4, 2, "")
    report = lib_attn.Report(calls={("dit", "sdpa"): 3}, parallel={key: (3, 3000)})
    data = json.loads(report.to_json())
    assert data["parallel"] == [{"role": "dit", "kind": "joint", "mode": "ulysses-ring", "ranks": 8, "ulysses": 4,
                                 "ring": 2, "note": "", "count": 3, "bytes_sent": 3000, "bytes_per_call": 1000}]
    assert lib_attn.Report.from_dict(data).parallel == {key: (3, 3000)}
    assert "parallel" not in lib_attn.Report().to_dict()  # only when calls ran split


def test_the_parallel_command_checks_and_times_every_mode(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the ranks it starts run "python -m lib_attn" from here
    code = cli.main(["parallel", "--ranks", "2", "--model", "flux", "--res", "256", "--scale", "4", "--repeat", "1",
                     "--timeout", "120", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads(out)
    assert doc["ok"] and doc["ranks"] == 2 and doc["backend"] == "gloo" and doc["scale"] == 4
    assert {row["grid"] for row in doc["rows"]} == {"2x1", "1x2"}
    for row in doc["rows"]:
        assert row["kind"] == "joint" and row["err"] <= row["bound"]
        assert row["bytes_per_call"] == row["bytes_formula"] > 0  # 256 image tokens split evenly
        assert row["ms_parallel"] > 0 and row["ms_one_process"] > 0


def test_the_parallel_command_refuses_one_rank(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["parallel", "--ranks", "1"])
    assert exc.value.code == 2 and "--ranks 1: needs 2 or more" in capsys.readouterr().err


def test_the_backend_of_each_device_is_read_from_torchs_configuration_text():
    from lib_attn.parallel import mesh

    assert mesh.device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert mesh.device_backends("cpu:gloo,cuda:gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert mesh.device_backends("nccl") == {"*": "nccl"}
    assert mesh.describe_backends({"cpu": "gloo", "cuda": "gloo"}) == "gloo"
    assert mesh.describe_backends({"cuda": "nccl", "cpu": "gloo"}) == "cpu: gloo, cuda: nccl"


def test_group_names_come_from_ranks_configuration_and_channel_alone():
    from lib_attn.parallel import mesh

    values = ((0, 1, 2, 3), 2, 2, 30.0, "gloo")
    name = mesh.group_name("ulysses 0", (0, 1), values, 0)
    assert name == mesh.group_name("ulysses 0", (0, 1), values, 0) and name.startswith("lib_attn:")
    others = [mesh.group_name("ulysses 0", (4, 5), values, 0), mesh.group_name("ring 0", (0, 1), values, 0),
              mesh.group_name("ulysses 0", (0, 1), values, 1), mesh.group_name("ulysses 0", (0, 1), values, 0, 1),
              mesh.group_name("ulysses 0", (0, 1), ((0, 1, 2, 3), 2, 2, 60.0, "gloo"), 0)]
    assert len({name, *others}) == 6
