"""The guard's first check and tuning on a real CUDA device, at video length: no copy of the call.

Peak memory is the allocator's (``torch.cuda.max_memory_allocated``) over what was allocated before
the call, output excluded. Prints the figures, first call and steady call, for the run's notes.
"""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import check, tune
from tests import faulty_backends
from tests.engine_helpers import fresh_engine_with, make_qkv, reference, rel_err

MIB = 2**20
# Wan 2.2 at 720p, 81 frames: 75,600 tokens, 40 heads of 128; here 8 of its heads (the check's cost
# does not depend on the heads) and the 480p length, 32,760 tokens.
WAN_480P = (1, 8, 32760, 32760, 128)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    with fresh_engine_with(monkeypatch, tmp_path, faulty_backends):
        yield


def cuda_qkv(shape, dtype=torch.bfloat16, seed=0):
    b, h, n, kv, d = shape
    return tuple(t.cuda() for t in make_qkv(b, h, n, kv, d, dtype, seed=seed))


def extra_peak(fn) -> tuple:
    """(output, MiB the allocator's peak rose during ``fn()`` beyond its output)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()) / MIB


@pytest.mark.parametrize("guard, tune_mode", [("on", "off"), ("off", "off"), ("on", "on")])
def test_a_video_length_first_call_costs_no_copy_of_the_inputs(guard, tune_mode):
    lib_attn.configure(guard=guard, tune=tune_mode, preference=["sdpa-flash", "sdpa"])
    q, k, v = cuda_qkv(WAN_480P)
    tensor_mib = q.numel() * q.element_size() / MIB
    out, first = extra_peak(lambda: lib_attn.attention(q, k, v, role="dit"))
    _, steady = extra_peak(lambda: lib_attn.attention(q, k, v, role="dit"))
    print(f"guard {guard}, tune {tune_mode}: one input {tensor_mib:.0f} MiB; extra peak first call "
          f"{first:.1f} MiB, steady {steady:.1f} MiB; {lib_attn.explain(q, k, v, role='dit').backend}")
    assert first < tensor_mib / 8, f"first call {first:.1f} MiB over its output"
    assert rel_err(out[:, :2], reference(q[:, :2], k[:, :2], v[:, :2])) < check.BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("bid, what", [
    ("fk-nan", "non-finite values"), ("fk-drift", "rel err"), ("fk-writes", "wrote into its inputs")])
@pytest.mark.parametrize("tune_mode", ["off", "on"])
def test_faults_are_caught_on_the_first_call_with_the_callers_tensors_unchanged(bid, what, tune_mode, monkeypatch):
    monkeypatch.setattr(faulty_backends._Faulty, "devices", ("cuda", "cpu"))
    lib_attn.configure(preference=[bid, "sdpa"], tune=tune_mode)
    q, k, v = cuda_qkv((2, 8, 4096, 77, 40), torch.float16, seed=1)
    kept = tuple(t.clone() for t in (q, k, v))
    out = lib_attn.attention(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), kept))
    d = lib_attn.explain(q, k, v)
    assert d.backend != bid and what in " ".join(d.reasons_for(bid))
    assert rel_err(out, reference(*kept)) < check.BOUNDS[torch.float16]


def test_tuning_times_a_part_of_a_long_call():
    lib_attn.configure(tune="on")
    q, k, v = cuda_qkv(WAN_480P)
    lib_attn.attention(q, k, v, role="dit")
    d = lib_attn.explain(q, k, v, role="dit")
    part, share = tune.timed_part(q, k, v, None, "bhsd")
    print(f"tuned on {tuple(part[0].shape)} (share {share:.3f}): {d}")
    assert d.source == "measured" and share < 1 and part[0].data_ptr() == q.data_ptr()


@pytest.mark.parametrize("bid", ["fk-scale-long", "fk-sign-long", "fk-trade-long"])
def test_a_sign_flip_or_scaling_at_full_size_is_rejected_and_the_callers_tensors_restored(bid, monkeypatch):
    monkeypatch.setattr(faulty_backends._Faulty, "devices", ("cuda", "cpu"))
    lib_attn.configure(preference=[bid, "sdpa"], tune="off")
    n = faulty_backends.LONG * 8
    q, k, v = cuda_qkv((1, 8, n, n, 128), torch.bfloat16, seed=2)
    kept = tuple(t.clone() for t in (q, k, v))
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="dit")
    assert all(check.same_bits(a, b) for a, b in zip((q, k, v), kept))
    ((_, caught, said, _, recomputed), _), = rec.guard.items()
    assert caught == bid and recomputed and said.endswith(check.WROTE_RESTORED)
    assert rel_err(out[:, :2], reference(*(t[:, :2] for t in kept))) < check.BOUNDS[torch.bfloat16]
