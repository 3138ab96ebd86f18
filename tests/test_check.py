"""The output check the guard and tuning share: which rows, the streamed reference against float64,
the verdict, the probe's part of a call, and the checksums that see a write."""
from __future__ import annotations

import pytest
import torch

from lib_attn import check
from tests.engine_helpers import make_qkv, reference, rel_err


def rows_of(full, layout, s):
    """The sampled rows of a (b, h, q, d) or (b, q, h, d) tensor, (pairs, rows, d)."""
    t = full.transpose(1, 2) if layout == "bshd" else full
    return t[s.batch[:, None], s.head[:, None], s.rows[None, :]]


def test_samples_cover_every_row_of_a_small_call_and_a_bounded_spread_of_a_large_one():
    q = torch.empty(2, 4, 24, 8)
    s = check.samples(q, "bhsd")
    assert s.batch.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and s.head.tolist() == [0, 1, 2, 3] * 2
    assert s.rows.tolist() == list(range(24))
    # Wan 2.2 at 720p: 40 heads, 75,600 queries. Every head, rows spread from the first to the last.
    s = check.samples(torch.empty(1, 75600, 40, 1), "bshd")
    assert len(s.batch) == 40 and s.count <= check.SAMPLES
    assert s.rows[0] == 0 and s.rows[-1] == 75599 and len(s.rows) == check.SAMPLES // 40
    # More pairs than PAIRS: a spread of them, first and last included, never more than SAMPLES rows.
    s = check.samples(torch.empty(16, 40, 4096, 1), "bhsd")
    pairs = (s.batch * 40 + s.head).tolist()
    assert len(pairs) == check.PAIRS and pairs[0] == 0 and pairs[-1] == 16 * 40 - 1 and pairs == sorted(set(pairs))
    assert s.count <= check.SAMPLES


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "key-padding"])
def test_the_reference_matches_float64_attention_on_the_sampled_rows(layout, dtype, mask_kind, monkeypatch):
    monkeypatch.setattr(check, "BLOCK_BYTES", {"cpu": 2048})  # many key blocks: the online softmax's merge is exercised
    monkeypatch.setattr(check, "ROWS_PER_BLOCK", 5)
    q, k, v = make_qkv(2, 3, 70, 300, 16, dtype, layout=layout, seed=None)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 3, 70, 300) > 0.4
        mask[..., 7] = True
    elif mask_kind == "float":
        mask = torch.randn(2, 3, 70, 300, dtype=dtype)
    elif mask_kind == "key-padding":
        mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
        mask[1, ..., 250:] = False
    s = check.samples(q, layout)
    ref = check.reference(q, k, v, mask, 0.3, layout, s)
    assert ref.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = rows_of(reference(q, k, v, mask, 0.3, layout), layout, s)
    # Computed from the same (rounded) inputs in fp32: fp32's accumulation error, whatever the input dtype.
    assert rel_err(ref, want) < (1e-12 if dtype == torch.float64 else 2e-6)


def test_a_fully_masked_row_is_non_finite_as_in_every_kernel_and_the_check_then_passes():
    q, k, v = make_qkv(1, 1, 8, 200, 16, torch.float32, seed=1)
    mask = torch.ones(1, 1, 8, 200, dtype=torch.bool)
    mask[0, 0, 3] = False
    s = check.samples(q, "bhsd")
    ref = check.reference(q, k, v, mask, None, "bhsd", s)
    assert torch.isnan(ref[0, 3]).all() and torch.isfinite(ref[0, [0, 1, 2, 4]]).all()
    assert check.check(torch.zeros(1, 1, 8, 16), q.shape, "bhsd", s, ref, 1e-3) == ""


def test_the_reference_stays_fp32_under_autocast():
    q, k, v = make_qkv(1, 2, 80, 50, 32, torch.float32, seed=7)
    s = check.samples(q, "bhsd")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = check.reference(q, k, v, None, None, "bhsd", s)
    assert ref.dtype == torch.float32
    assert rel_err(ref, rows_of(reference(q, k, v), "bhsd", s)) < 1e-6


def test_the_verdict_names_what_is_wrong():
    q, k, v = make_qkv(1, 1, 300, 200, 64, torch.float16, seed=3)
    s = check.samples(q, "bhsd")
    ref = check.reference(q, k, v, None, None, "bhsd", s)
    good = reference(q, k, v).to(torch.float16)
    assert check.check(good, q.shape, "bhsd", s, ref, check.BOUNDS[torch.float16]) == ""
    noisy = good + 0.2 * torch.randn_like(good)
    reason = check.check(noisy, q.shape, "bhsd", s, ref, check.BOUNDS[torch.float16])
    assert reason.startswith("output check failed: rel err ") and reason.endswith("> 2.0e-02")
    bad = good.clone()
    bad[0, 0, 299, 5] = float("nan")  # the last row is always sampled
    assert check.check(bad, q.shape, "bhsd", s, ref, 1.0) == "output check failed: non-finite values"
    assert "shape" in check.check(good[:, :, :10], q.shape, "bhsd", s, ref, 1.0)
    assert check.check((good,), q.shape, "bhsd", s, ref, 1.0) == \
        "output check failed: shape tuple, expected (1, 1, 300, 64)"


def test_the_bound_is_the_dtypes_looser_under_autocast_and_for_approximate_kernels():
    assert check.bound(torch.float32, "cpu", False) == check.BOUNDS[torch.float32]
    assert check.bound(torch.float16, "cpu", True) == check.BOUNDS[torch.float16] * check.APPROXIMATE_FACTOR
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check.bound(torch.float32, "cpu", False) == check.BOUNDS[torch.bfloat16]


def test_a_small_call_is_probed_whole_on_copies():
    q, k, v = make_qkv(2, 4, 24, 20, 16, torch.float32, seed=0)
    p = check.probe(q, k, v, None, "bhsd")
    assert p.whole and p.q.shape == q.shape and p.k.shape == k.shape
    assert all(c.data_ptr() != t.data_ptr() and torch.equal(c, t) for c, t in zip((p.q, p.k, p.v), (q, k, v)))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_large_call_is_probed_on_a_small_part_that_keeps_its_lengths_remainders(layout):
    q, k, v = make_qkv(2, 8, 4096 + 37, 77, 40, torch.float32, layout=layout, seed=0)
    mask = torch.rand(2, 1, 4096 + 37, 77) > 0.2
    p = check.probe(q, k, v, mask, layout)
    seq = 2 if layout == "bhsd" else 1
    assert not p.whole and p.q.shape[0] == 1 and p.q.shape[3 - seq] == 1
    n, kv = p.q.shape[seq], p.k.shape[seq]
    assert kv == 77  # short enough to keep: SD's text length, where padded key blocks go wrong
    assert n < 4096 and n % check.PROBE_ALIGN == (4096 + 37) % check.PROBE_ALIGN
    assert sum(t.numel() * t.element_size() for t in (p.q, p.k, p.v)) <= check.PROBE_BYTES + 3 * check.PROBE_ALIGN * 160
    assert p.mask.shape == (1, 1, n, 77) and torch.equal(p.mask, mask[:1, :1, :n])
    # The copies are new storage, equal to the caller's first item, head and positions.
    q_part = q[:1, :1, :n] if layout == "bhsd" else q[:1, :n, :1]
    assert p.q.data_ptr() != q.data_ptr() and torch.equal(p.q, q_part)
    assert p.sources[0].data_ptr() == q.data_ptr()
    assert p.untouched()
    p.k.mul_(2)
    assert not p.untouched()
    p = p.renewed()
    assert p.untouched() and p.k.data_ptr() != k.data_ptr()


def test_a_long_call_on_both_sides_is_cut_on_both():
    q, k, v = make_qkv(1, 4, 16384, 16384, 64, torch.float32, seed=0)
    p = check.probe(q, k, v, None, "bhsd")
    assert p.q.shape == (1, 1, p.q.shape[2], 64) and p.q.shape[2] < 16384 and p.k.shape[2] < 16384
    assert sum(t.numel() * t.element_size() for t in (p.q, p.k, p.v)) <= check.PROBE_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_checksums_see_one_changed_bit_and_the_same_bits_give_the_same_sums(dtype):
    base = torch.randn(2, 77, 3, 8, 40).to(dtype)
    k = base[:, :, 1]  # a strided view, as hosts pass a packed qkv
    before = check.checksums(k)
    for _ in range(3):
        assert not check.changed(before, k)
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[k.element_size()]
    for where in ((1, 50, 3, 17), (0, 0, 0, 0), (1, 76, 7, 39)):
        flipped = k.clone()
        flipped.view(as_int)[where] ^= 1  # the lowest bit of one element
        assert check.changed(before, flipped), where
    # The sums of words do not depend on the layout the values sit in (the sum of values may, by rounding).
    assert torch.equal(check.checksums(k.contiguous())[0][:2], before[0][:2])
