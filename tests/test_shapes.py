"""The attention call sets derived from model architectures: counts, shapes, FLOPs, H200 floors.

Expected values are the figures of the performance reference (§1.2, §1.3, §3.2), which were
obtained by instantiating the reference implementations on the meta device; the FLOP formula is
checked against PyTorch's own FLOP counter on the two matmuls of attention.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lib_attn import shapes


@pytest.mark.parametrize("model, per_step", [
    ("sd15", 32), ("sd2", 32), ("sdxl", 140), ("sd3", 24), ("flux", 57), ("vae", 1),
])
@pytest.mark.parametrize("res", [None, 768, 1536])
def test_calls_per_step_do_not_depend_on_resolution(model, per_step, res):
    assert shapes.calls_per_step(model, res) == per_step


def test_sd15_self_and_cross_pairs_with_fixed_heads():
    calls = shapes.model_calls("sd15", 512)
    selfs = [c for c in calls if c.kind == "self"]
    cross = [c for c in calls if c.kind == "cross"]
    assert sum(c.calls for c in selfs) == sum(c.calls for c in cross) == 16
    assert {c.heads for c in calls} == {8}
    assert [c.head_dim for c in selfs] == [40, 80, 160, 160]
    assert [c.q_len for c in selfs] == [4096, 1024, 256, 64]
    assert all(c.kv_len == c.q_len for c in selfs)
    assert all(c.kv_len == 77 for c in cross)
    assert all(c.b == 2 and c.role == "unet" for c in calls)


def test_sd2_has_64_wide_heads_and_head_count_follows_channels():
    selfs = [c for c in shapes.model_calls("sd2", 768) if c.kind == "self"]
    assert [(c.heads, c.head_dim, c.q_len) for c in selfs] == [
        (5, 64, 9216), (10, 64, 2304), (20, 64, 576), (20, 64, 144)]


def test_sdxl_level2_and_middle_merge_into_sixty_calls():
    calls = {(c.kind, c.where): c for c in shapes.model_calls("sdxl", 1024)}
    assert calls[("self", "self L1")].shape == (2, 10, 4096, 4096, 64)
    assert calls[("self", "self L1")].calls == 10
    merged = calls[("self", "self L2+mid")]
    assert merged.shape == (2, 20, 1024, 1024, 64) and merged.calls == 60
    assert calls[("cross", "cross L2+mid")].shape == (2, 20, 1024, 77, 64)


@pytest.mark.parametrize("model, res, shape", [
    ("sd3", 1024, (2, 24, 4250, 4250, 64)),
    ("flux", 1024, (1, 24, 4608, 4608, 128)),
    ("flux", 512, (1, 24, 1536, 1536, 128)),
    ("vae", 512, (1, 1, 4096, 4096, 512)),
    ("vae", 1024, (1, 1, 16384, 16384, 512)),
])
def test_single_call_models(model, res, shape):
    (call,) = shapes.model_calls(model, res)
    assert call.shape == shape
    assert call.role == ("vae" if model == "vae" else "dit")


def _counted_flops(b, h, q_len, kv_len, d) -> int:
    """FLOPs PyTorch's counter sees for softmax(QKᵀ)V's two matmuls, on meta tensors."""
    q = torch.empty(b, h, q_len, d, device="meta")
    k = torch.empty(b, h, kv_len, d, device="meta")
    v = torch.empty(b, h, kv_len, d, device="meta")
    with FlopCounterMode(display=False) as counter:
        (q @ k.transpose(-1, -2)).softmax(-1) @ v
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(2, 8, 4096, 4096, 40), (2, 8, 4096, 77, 40), (1, 24, 4608, 4608, 128),
                                   (1, 1, 16384, 16384, 512), (3, 5, 7, 11, 13)])
def test_flop_formula_matches_pytorch_flop_counter(shape):
    assert shapes.attention_flops(*shape) == _counted_flops(*shape)


def test_every_call_flops_match_the_counter():
    for model in shapes.MODELS:
        for call in shapes.model_calls(model):
            assert call.flops == _counted_flops(*call.shape)
            assert call.step_flops == call.flops * call.calls


def _as_printed(text: str):
    """A value as the reference prints it: equal up to half a unit of its last digit."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return pytest.approx(float(text), abs=0.5 * 10 ** -decimals, rel=0)


@pytest.mark.parametrize("model, res, where, gflop_per_call, calls", [
    ("sd15", 512, "self L0", "42.9", 5), ("sd15", 512, "self L1", "5.37", 5),
    ("sd15", 512, "cross L0", "0.807", 5), ("sd15", 512, "cross L1", "0.404", 5),
    ("sd15", 512, "self L2", "0.671", 5), ("sd15", 512, "cross L2", "0.202", 5),
    ("sd15", 512, "self mid", "0.042", 1), ("sd15", 512, "cross mid", "0.050", 1),
    ("sd15", 768, "self L0", "217", 5), ("sd15", 1024, "self L0", "687", 5), ("sd15", 1024, "self L1", "85.9", 5),
    ("sd2", 768, "self L0", "217", 5), ("sd2", 768, "self L2", "3.40", 5), ("sd2", 768, "cross L0", "1.82", 5),
    ("sdxl", 1024, "self L1", "85.9", 10), ("sdxl", 1024, "self L2+mid", "10.7", 60),
    ("sdxl", 1024, "cross L1", "1.61", 10), ("sdxl", 1024, "cross L2+mid", "0.807", 60),
    ("sdxl", 1536, "self L1", "435", 10), ("sdxl", 1536, "self L2+mid", "54.4", 60),
    ("sd3", 1024, "joint", "222", 24), ("flux", 1024, "joint", "261", 57), ("flux", 512, "joint", "29.0", 57),
    ("vae", 512, "mid", "34.4", 1), ("vae", 1024, "mid", "550", 1),
])
def test_gflop_per_call_match_reference_table(model, res, where, gflop_per_call, calls):
    call = {c.where: c for c in shapes.model_calls(model, res)}[where]
    assert call.calls == calls
    assert call.flops / 1e9 == _as_printed(gflop_per_call)


@pytest.mark.parametrize("model, res, gflop_per_step", [
    ("sd15", 512, "252"), ("sd15", 768, "1256"), ("sd15", 1024, "3948"), ("sd2", 512, "252"), ("sd2", 768, "1256"),
    ("sdxl", 768, "512"), ("sdxl", 1024, "1568"), ("sdxl", 1536, "7755"), ("sd3", 1024, "5327"),
    ("flux", 512, "1652"), ("flux", 1024, "14872"), ("vae", 512, "34"), ("vae", 1024, "550"),
])
def test_gflop_per_step_match_reference_table(model, res, gflop_per_step):
    assert shapes.step_flops(model, res) / 1e9 == _as_printed(gflop_per_step)


@pytest.mark.parametrize("shape, floor_us", [
    ((2, 8, 4096, 4096, 40), 68.8),   # exp-bound
    ((2, 8, 1024, 1024, 80), 5.4),    # tensor-bound
    ((2, 8, 4096, 77, 40), 2.2),      # HBM-bound
    ((2, 20, 1024, 77, 64), 2.4),     # HBM-bound
    ((2, 20, 1024, 1024, 64), 10.9),  # tensor ≈ exp
    ((1, 24, 4608, 4608, 128), 264),  # tensor-bound
    ((1, 1, 16384, 16384, 512), 556),
])
def test_h200_floor_matches_reference(shape, floor_us):
    assert shapes.h200_floor_s(*shape) * 1e6 == pytest.approx(floor_us, rel=0.03)


def test_native_resolution_is_the_default():
    for model in shapes.IMAGE_MODELS:
        assert shapes.model_calls(model) == shapes.model_calls(model, shapes.NATIVE_RES[model])
    for model in shapes.VIDEO_MODELS:  # every preset resolution
        assert shapes.model_calls(model) == [c for r in shapes.VIDEO_RES[model] for c in shapes.model_calls(model, r)]


@pytest.mark.parametrize("model, res", [("sd15", 500), ("sd15", 0), ("flux", 1000), ("sd3", -16)])
def test_bad_resolution_is_a_value_error(model, res):
    with pytest.raises(ValueError, match="res"):
        shapes.model_calls(model, res)


def test_unknown_model_lists_the_valid_ones():
    with pytest.raises(ValueError, match="sd15.*flux"):
        shapes.model_calls("sd4")
