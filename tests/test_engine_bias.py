"""The additive bias handed to fused kernels: right values, aligned strides, no needless copies."""
from __future__ import annotations

import pytest
import torch

from lib_attn.kernels.base import additive_bias


def aligned(bias: torch.Tensor, align: int) -> bool:
    return bias.stride(-1) == 1 and all(s % align == 0 for s in bias.stride()[:-1])


def reference_bias(mask, shape, neg=float("-inf")):
    m = mask.expand(shape)
    return torch.where(m, 0.0, neg) if m.dtype == torch.bool else m.float()


@pytest.mark.parametrize("mask_shape, shape", [
    ((2, 1, 1, 77), (2, 8, 64, 77)),     # key padding, unaligned kv
    ((1, 1, 1, 80), (2, 8, 64, 80)),     # key padding, aligned kv
    ((2, 8, 64, 77), (2, 8, 64, 77)),    # dense
    ((64, 77), (2, 8, 64, 77)),          # 2-D, broadcast over batch and heads
    ((77,), (2, 8, 64, 77)),             # 1-D over keys
    ((2, 1, 64, 1), (2, 8, 64, 80)),     # broadcast over keys
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_bias_values_and_alignment(mask_shape, shape, kind):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    mask = torch.rand(mask_shape, generator=gen) > 0.3 if kind == "bool" else torch.randn(mask_shape, generator=gen)
    bias = additive_bias(mask, torch.float32, shape, 16)
    assert tuple(bias.shape) == shape
    assert aligned(bias, 16)
    assert torch.equal(bias, reference_bias(mask, shape))


def test_key_padding_bias_stays_one_row_per_batch_item():
    mask = torch.ones(2, 1, 1, 77, dtype=torch.bool)
    bias = additive_bias(mask, torch.float16, (2, 8, 4096, 77), 16)
    assert bias.stride()[1:3] == (0, 0)  # broadcast over heads and queries, not materialised
    assert bias.untyped_storage().nbytes() == 2 * 80 * 2


def test_unaligned_float_view_is_copied_into_an_aligned_buffer():
    base = torch.randn(2, 8, 64, 66)
    mask = base[..., :64]  # a view whose rows are 66 elements apart
    bias = additive_bias(mask, torch.float32, (2, 8, 64, 64), 16)
    assert aligned(bias, 16) and torch.equal(bias, mask)


def test_finite_negative_for_cudnn():
    mask = torch.tensor([True, False, True])
    bias = additive_bias(mask, torch.float16, (1, 1, 2, 3), 16, neg=-65504.0)
    assert torch.isfinite(bias).all() and bias[0, 0, 0, 1] == -65504.0
