"""The output guard: faulty kernels, named alone, never reach the caller; what it caught is reported,
remembered on disk, and listed by ``doctor``."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import check, dispatch, guard, tuning_file
from lib_attn.report import Report
from tests import faulty_backends
from tests.engine_helpers import fresh_engine_with, make_qkv
from lib_attn.readout import guard_lines

CALLS = faulty_backends.CALLS


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    with fresh_engine_with(monkeypatch, tmp_path, faulty_backends):
        yield


def qkv(seed, dtype=torch.float32):
    return make_qkv(2, 4, 24, 20, 16, dtype, seed=seed)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("bid, what", [
    ("fk-nan", "non-finite values"), ("fk-nan3", "non-finite values"), ("fk-drift", "rel err"),
    ("fk-shape", "shape"), ("fk-writes", "wrote into its inputs")])
def test_a_faulty_kernel_named_alone_never_reaches_the_caller(bid, what):
    lib_attn.configure(preference=[bid])
    with lib_attn.recording() as rec:
        for seed in range(7):
            q, k, v = qkv(seed)
            kept = tuple(t.clone() for t in (q, k, v))
            out = lib_attn.attention(q, k, v)
            assert all(torch.equal(a, b) for a, b in zip((q, k, v), kept)), "the caller's inputs changed"
            assert torch.equal(out, sdpa(*kept))
    assert CALLS[bid] >= 1  # it did run, and was caught
    ((role, caught, said, ran_on, recomputed), n), = rec.guard.items()
    assert (role, caught, ran_on, recomputed, n) == ("unet", bid, "sdpa", True, 1) and what in said
    (line,) = guard_lines(Report.from_recording(rec))
    assert line.startswith(f"guard: {bid}") and what in line and line.endswith("→ sdpa (recomputed)")


def test_a_rejection_names_the_call_and_the_bound():
    lib_attn.configure(preference=["fk-drift"])
    q, k, v = make_qkv(2, 8, 64, 77, 40, torch.bfloat16, seed=3)  # torch 2.1's CPU has no fp16 attention
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
    (line,) = guard_lines(Report.from_recording(rec))
    assert line.startswith("guard: fk-drift rejected for unet 2×8×64×77×40 bf16: rel err ")
    err, bound = (float(x) for x in line.split("rel err ")[1].split(" →")[0].split(" > "))
    assert 0.05 < err < 0.2 and bound == check.BOUNDS[torch.bfloat16]


def test_a_late_fault_of_a_trusted_approximate_kernel_is_recomputed_and_demotes_it():
    lib_attn.configure(preference=["fk-nan3"])
    with lib_attn.recording() as rec:
        outs = [(lib_attn.attention(*qkv(s)), sdpa(*qkv(s))) for s in range(6)]
    assert all(torch.equal(a, b) for a, b in outs)
    assert CALLS["fk-nan3"] == 3  # the third call was caught; from then on sdpa serves the signature
    assert lib_attn.explain(*qkv(0)).backend == "sdpa"
    assert rec.guard == {("unet", "fk-nan3", "non-finite values", "sdpa", True): 1}


def test_an_exact_kernel_is_screened_on_a_sample_and_full_mode_screens_every_call(monkeypatch):
    screened = []
    real = guard.non_finite_blame
    monkeypatch.setattr(guard, "non_finite_blame", lambda *a: screened.append(1) or real(*a))
    monkeypatch.setattr(faulty_backends.NaNEveryThird, "approximate", False)
    lib_attn.configure(preference=["fk-drift", "sdpa"])  # fk-drift is rejected: sdpa, exact, serves
    q, k, v = qkv(0)
    for _ in range(2 * guard.SAMPLE_EVERY + 2):
        lib_attn.attention(q, k, v)
    assert len(screened) == 2
    # An exact kernel that fails on every third call: the sample may miss it, full mode does not.
    lib_attn.configure(preference=["fk-nan3"], guard="full")
    CALLS.clear()
    for s in range(9):
        assert torch.equal(lib_attn.attention(*qkv(s)), sdpa(*qkv(s)))
    assert CALLS["fk-nan3"] == 3


def test_on_cuda_the_screen_is_read_later_and_the_call_in_hand_is_recomputed(monkeypatch):
    # The device-side count, read when its copy has landed (on the CPU at once: one call later).
    monkeypatch.setattr(guard, "DEFERRED", ("cpu",))
    lib_attn.configure(preference=["fk-nan3"])
    with lib_attn.recording() as rec:
        outs = [(lib_attn.attention(*qkv(s)), sdpa(*qkv(s))) for s in range(5)]
    assert outs[2][0].isnan().all()  # the faulty call had returned before its screen was read
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(outs) if i != 2)
    assert rec.guard == {("unet", "fk-nan3", "non-finite values", "sdpa", False): 1}
    (line,) = guard_lines(Report.from_recording(rec))
    assert line == "guard: fk-nan3 ×1 non-finite values → sdpa (found after it returned: not recomputed)"


def test_non_finite_inputs_are_not_the_kernels_fault():
    lib_attn.configure(preference=["fk-nan3"])
    q, k, v = qkv(0)
    lib_attn.attention(q, k, v)
    q[0, 0, 0, 0] = float("nan")
    with lib_attn.recording() as rec:
        for _ in range(4):
            lib_attn.attention(q, k, v)  # call 3 of fk-nan3 is NaN everywhere, but so are the inputs
    assert not rec.guard and lib_attn.explain(q, k, v).backend == "fk-nan3"


def test_a_rejection_is_remembered_across_starts_and_doctor_lists_it():
    from lib_attn.commands import doctor

    lib_attn.configure(preference=["fk-drift"])
    q, k, v = qkv(0)
    lib_attn.attention(q, k, v)
    assert CALLS["fk-drift"] == 1
    tuning_file.forget_memory()  # a new process reads the file
    dispatch.reset()
    d = lib_attn.explain(q, k, v)
    assert d.backend == "sdpa" and d.reasons_for("fk-drift")[0].startswith("output check failed: rel err")
    lib_attn.attention(q, k, v)
    assert CALLS["fk-drift"] == 1  # not run again
    (found,) = tuning_file.remembered()
    sig, bid, reason = found["signature"], found["backend"], found["reason"]
    assert bid == "fk-drift" and sig == tuning_file.signature(d.spec, "cast") and reason.startswith("output check failed")
    text = doctor.render(doctor.report(torch.device("cpu")))
    assert "guard     on; 1 output check failures remembered" in text and "python -m lib_attn tune --clear" in text
    assert f"    fk-drift for {sig}: output check failed: rel err" in text
    assert tuning_file.clear() and tuning_file.remembered() == []


def test_strict_mode_stops_and_says_why():
    lib_attn.configure(preference=["fk-nan"], strict=True)
    with pytest.raises(lib_attn.AttentionFallbackError, match="strict mode: guard: fk-nan rejected for unet "
                                                              "2×4×24×20×16 fp32: non-finite values"):
        lib_attn.attention(*qkv(0))


def test_off_runs_the_kernel_as_asked():
    lib_attn.configure(preference=["fk-nan"], guard="off")
    assert lib_attn.attention(*qkv(0)).isnan().all()


def test_a_bad_guard_mode_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="guard 'always' is not one of on, full, off"):
        lib_attn.configure(guard="always")
    assert lib_attn.config().guard == "on"


def test_a_kernel_that_passes_is_trusted_and_counted_once(caplog):
    lib_attn.configure(preference=["sdpa"])
    q, k, v = qkv(0)
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        out = [lib_attn.attention(q, k, v) for _ in range(3)]
    assert rec.calls == {("unet", "sdpa"): 3} and not rec.guard and not caplog.records
    assert all(torch.equal(o, sdpa(q, k, v)) for o in out)


def test_the_webuis_flag_and_setting():
    from types import SimpleNamespace

    from webui_attn.settings import flags, stored

    assert flags.layer_from(SimpleNamespace(attn_guard="full")) == {"guard": "full"}
    assert flags.problems(SimpleNamespace(attn_guard="always")) == [
        "--attn-guard 'always': must be one of on, full, off. The flag is ignored."]
    assert flags.layer_from(SimpleNamespace(attn_guard="always")) is None
    assert stored.layer_from({stored.KEY_GUARD: "off"}) == {"guard": "off"}
    assert stored.layer_from({stored.KEY_GUARD: "Auto"}) is None
    (problem,) = stored.problems({stored.KEY_GUARD: "sometimes"})
    assert problem == "setting flash_attn_guard='sometimes' ignored, Auto used; valid: Auto, on, full, off"


def test_a_kernel_is_checked_once_per_process_not_at_every_configuration_change(monkeypatch):
    checked = []
    real = guard.first_check
    monkeypatch.setattr(guard, "first_check", lambda *a, **kw: checked.append(1) or real(*a, **kw))
    q, k, v = qkv(0)
    for strict in (False, True, False):  # a webui changes the configuration around every generation
        lib_attn.configure(preference=["sdpa"], strict=strict)
        lib_attn.attention(q, k, v)
    assert len(checked) == 1
    lib_attn.configure(guard="full")  # full checks every call
    lib_attn.attention(q, k, v)
    lib_attn.attention(q, k, v)
    assert len(checked) == 3


def long_qkv(seed, dtype=torch.float32, n=1500):
    """A call above the probe's size: the probe runs on a part of it, the check on the whole."""
    q, k, v = make_qkv(2, 4, n, 300, 32, dtype, seed=seed)
    assert sum(t.numel() * t.element_size() for t in (q, k, v)) > check.PROBE_BYTES
    return q, k, v


def storage(*tensors):
    return tuple(t.untyped_storage().data_ptr() for t in tensors)


@pytest.mark.parametrize("bid, what", [
    ("fk-nan", "non-finite values"), ("fk-drift", "rel err"), ("fk-shape", "shape"),
    ("fk-writes", "wrote into its inputs")])
def test_a_long_calls_first_check_catches_every_fault_without_copying_the_call(bid, what):
    lib_attn.configure(preference=[bid])
    q, k, v = long_qkv(1)
    kept = tuple(t.clone() for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), kept)), "the caller's inputs changed"
    assert torch.equal(out, sdpa(*kept))
    ((_, caught, said, ran_on, recomputed), n), = rec.guard.items()
    assert (caught, ran_on, recomputed, n) == (bid, "sdpa", True, 1) and what in said
    first = faulty_backends.SEEN[bid][0]
    assert not set(first) & set(storage(q, k, v)), "the kernel's first run was on the caller's tensors"
    if bid == "fk-writes":  # caught on the probe: it never saw the caller's tensors
        assert CALLS[bid] == 1


def test_a_kernel_that_passes_the_first_check_of_a_long_call_runs_on_the_callers_tensors_from_then_on():
    lib_attn.configure(preference=["fk-nan3"])  # right on its first two calls: the probe and the call
    q, k, v = long_qkv(2)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    assert not rec.guard and torch.equal(out, sdpa(q, k, v))
    probe_run, call_run = faulty_backends.SEEN["fk-nan3"]
    assert not set(probe_run) & set(storage(q, k, v)) and call_run == storage(q, k, v)
    assert lib_attn.explain(q, k, v).backend == "fk-nan3"


def test_a_write_the_probe_cannot_show_is_caught_and_undone(caplog):
    lib_attn.configure(preference=["fk-writes-long"])
    q, k, v = long_qkv(3, n=faulty_backends.LONG + 500)
    kept = tuple(t.clone() for t in (q, k, v))
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    ((_, caught, said, ran_on, _), _), = rec.guard.items()
    assert caught == "fk-writes-long" and ran_on == "sdpa"
    assert said.endswith("wrote into its inputs at full size (the caller's tensors were restored)")
    assert all(check.same_bits(a, b) for a, b in zip((q, k, v), kept)), "the caller's tensors were not restored"
    assert torch.equal(out, sdpa(*kept))  # recomputed on the caller's inputs
    assert any("at full size" in r.getMessage() for r in caplog.records)


def test_a_write_with_no_room_for_copies_is_caught_and_said(monkeypatch):
    monkeypatch.setattr(check, "_host_copies", lambda tensors: None)
    lib_attn.configure(preference=["fk-writes-long"])
    q, k, v = long_qkv(3, n=faulty_backends.LONG + 500)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
    ((_, caught, said, ran_on, _), _), = rec.guard.items()
    assert said.endswith("wrote into its inputs at full size (the caller's tensors changed before it was caught)")
    assert torch.equal(out, sdpa(q, k, v)) and not v.any()  # recomputed on what the inputs now hold, as said


def reference64(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bid", ["fk-scale-long", "fk-sign-long", "fk-trade-long"])
def test_a_sign_flip_or_power_of_two_scaling_on_long_calls_is_rejected_and_undone(bid, dtype):
    # Every word of q changes by a multiple of 2^23 (fp32 exponent) or 2^31 (sign): 512 or 2 such
    # changes add up to nothing in a wrapping 32-bit sum, and every row here holds 16 fp32 words.
    lib_attn.configure(preference=[bid])
    q, k, v = long_qkv(8, dtype, n=faulty_backends.LONG + 24)
    kept = tuple(t.clone() for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
        assert all(check.same_bits(a, b) for a, b in zip((q, k, v), kept)), "the caller's tensors were not restored"
        ((_, caught, said, _, recomputed), n), = rec.guard.items()
        assert (caught, recomputed, n) == (bid, True, 1)
        assert said.endswith("wrote into its inputs at full size (the caller's tensors were restored)")
        ref = reference64(*kept)
        assert float((out.double() - ref).norm() / ref.norm()) < check.BOUNDS[dtype]
        runs = CALLS[bid]
        for _ in range(3):  # it has lost the signature: the inputs stay as they were
            lib_attn.attention(q, k, v)
        assert CALLS[bid] == runs and all(torch.equal(a, b) for a, b in zip((q, k, v), kept))


def test_the_fingerprint_changes_with_every_write_a_wrapping_sum_misses():
    # 2 heads × 4 queries × 128 fp32 words: 1,024 words, a multiple of 512 (2^9 × 2^23 = 2^32) and of 2.
    x = torch.randn(1, 2, 4, 128, dtype=torch.float64).float()
    fp = check.fingerprint(x)
    one_bit = x.clone()
    one_bit.view(torch.int32)[0, 1, 2, 3] ^= 1
    writes = {"×2": x * 2, "×0.125": x * 0.125, "sign": -x, "heads swapped": x.flip(1),
              "values moved along the row": x.roll(1, -1), "one bit": one_bit}
    for name, y in writes.items():
        assert not check.same_bits(x, y)
        assert not torch.equal(check.fingerprint(y), fp), name
    assert torch.equal(check.fingerprint(x.clone()), fp)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t = x.to(dtype)
        assert not torch.equal(check.fingerprint(-t), check.fingerprint(t)), dtype
        assert not torch.equal(check.fingerprint(t * 2), check.fingerprint(t)), dtype
    # Views the engine gets (a transposed bshd call, a strided timed part) are read in place.
    big = torch.randn(1, 600, 4, 64).transpose(1, 2)
    part = big[:, :2]
    before = check.fingerprint(part)
    big[:, 3].neg_()
    assert torch.equal(check.fingerprint(part), before)
    big[:, 1].neg_()
    assert not torch.equal(check.fingerprint(part), before)


@pytest.mark.parametrize("where", ["probe", "checksums", "reference"])
def test_no_memory_for_the_check_skips_it_for_that_call_and_the_call_runs(where, monkeypatch, caplog):
    real = getattr(check, where)
    failing = [True]

    def out_of_memory(*args, **kwargs):
        if failing[0]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.30 GiB")
        return real(*args, **kwargs)
    monkeypatch.setattr(check, where, out_of_memory)
    lib_attn.configure(preference=["sdpa"])
    q, k, v = long_qkv(4)
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
        assert torch.equal(out, sdpa(q, k, v)) and rec.calls == {("unet", "sdpa"): 1} and not rec.guard
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("attention guard: sdpa could not be checked on unet 2×4×1500×300×32 fp32, not checked "
                               "(RuntimeError: CUDA out of memory") and line.endswith("the next one is checked")
        checked = []
        monkeypatch.setattr(guard, "first_check", lambda *a, **kw: checked.append(1) or real_first(*a, **kw))
        failing[0] = False
        lib_attn.attention(q, k, v)  # the next call is checked, and passes
        assert checked == [1]
        lib_attn.attention(q, k, v)
        assert checked == [1]  # trusted from then on


real_first = guard.first_check


def test_tuning_never_runs_a_candidate_on_the_callers_tensors_before_it_is_seen_not_to_write():
    lib_attn.configure(preference=["fk-writes", "fk-drift", "sdpa"], tune="on")
    for q, k, v in (qkv(5), long_qkv(5)):
        kept = tuple(t.clone() for t in (q, k, v))
        out = lib_attn.attention(q, k, v)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), kept)), "the caller's tensors changed"
        assert torch.equal(out, sdpa(*kept))
        d = lib_attn.explain(q, k, v)
        assert d.backend == "sdpa" and d.source == "measured"
        assert d.reasons_for("fk-writes") == ["output check failed: wrote into its inputs"]
        assert d.reasons_for("fk-drift")[0].startswith("output check failed: rel err")
        assert all(not set(seen) & set(storage(q, k, v)) for seen in faulty_backends.SEEN.pop("fk-writes"))


def test_tuning_catches_and_undoes_a_write_at_full_size():
    lib_attn.configure(preference=["fk-writes-long", "sdpa"], tune="on")
    q, k, v = long_qkv(6, n=faulty_backends.LONG + 500)
    out = lib_attn.attention(q, k, v)
    d = lib_attn.explain(q, k, v)
    assert d.backend == "sdpa" and d.reasons_for("fk-writes-long") == [
        "output check failed: wrote into its inputs at full size (the caller's tensors were restored)"]
    assert torch.equal(out, sdpa(q, k, v)) and v.any()


@pytest.mark.parametrize("bid", ["fk-scale-long", "fk-sign-long", "fk-trade-long"])
def test_tuning_catches_and_undoes_a_sign_flip_or_scaling_at_full_size(bid):
    lib_attn.configure(preference=[bid, "sdpa"], tune="on")
    q, k, v = long_qkv(9, n=faulty_backends.LONG + 24)
    kept = tuple(t.clone() for t in (q, k, v))
    out = lib_attn.attention(q, k, v)
    assert all(check.same_bits(a, b) for a, b in zip((q, k, v), kept)), "the caller's tensors were not restored"
    d = lib_attn.explain(q, k, v)
    assert d.backend == "sdpa" and d.reasons_for(bid) == [
        "output check failed: wrote into its inputs at full size (the caller's tensors were restored)"]
    assert torch.equal(out, sdpa(*kept))


class _HalvesSharedKWhenLong(faulty_backends._WritesWhenLong):
    id, label = "fk-shared-k-long", "halves the memory of a batch-broadcast k on long calls"

    def write(self, q, k):
        k.data[:1].mul_(0.5)  # k is expanded over the batch: its first item is all of its memory


def test_a_write_into_an_input_expanded_over_the_batch_is_undone():
    # A context shared by the batch is passed expanded (stride 0): its elements share memory, which a
    # plain copy back refuses; the memory is put back through one index of each broadcast dimension.
    lib_attn.register_backend(_HalvesSharedKWhenLong())
    try:
        lib_attn.configure(preference=["fk-shared-k-long", "sdpa"])
        q, k, v = long_qkv(5, n=faulty_backends.LONG + 100)
        shared = k[:1].clone()
        k = shared.clone().expand_as(q[:, :, :k.shape[2]])
        base = k[:1].clone()
        with lib_attn.recording() as rec:
            out = lib_attn.attention(q, k, v)
        ((_, caught, said, ran_on, _), _), = rec.guard.items()
        assert (caught, ran_on) == ("fk-shared-k-long", "sdpa")
        assert said.endswith("wrote into its inputs at full size (the caller's tensors were restored)"), said
        assert torch.equal(k[:1], base), "the caller's k was not restored"
        assert torch.equal(out, sdpa(q, k.contiguous(), v))
    finally:
        lib_attn.unregister_backend("fk-shared-k-long")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_fingerprint_changes_when_tokens_are_reordered_in_place(dtype, layout):
    # A kernel that sorts or tiles tokens in place and does not put them back: every column's sum
    # along the sequence stays as it was, and the sum of all values changes only by rounding, if at all.
    gen = torch.Generator().manual_seed(7)
    shape = (1, 4, 256, 64) if layout == "bhsd" else (1, 256, 4, 64)
    seq = 2 if layout == "bhsd" else 1
    for trial in range(40):
        x = torch.randn(shape, generator=gen).to(dtype)
        i, j = torch.randperm(256, generator=gen)[:2].tolist()
        swapped = x.clone()
        swapped.index_copy_(seq, torch.tensor([i, j]), x.index_select(seq, torch.tensor([j, i])))
        for name, y in (("two tokens swapped", swapped), ("tokens rolled", x.roll(1 + trial, seq))):
            assert not check.same_bits(x, y)
            assert not torch.equal(check.fingerprint(y), check.fingerprint(x)), (name, trial)
