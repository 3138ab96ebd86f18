"""The bench's inputs and their reference: seeded random q, k, v laid out as A1111 passes them
(``(b, s, h·d)`` projections viewed as ``(b, s, h, d)`` and transposed to ``(b, h, s, d)``, so not
contiguous), and the float64 result on evenly spaced query rows that each output is checked against."""
from __future__ import annotations

from typing import Tuple

import torch

from lib_attn import shapes

ERROR_ROWS = 256


def make_inputs(call: shapes.AttentionCall, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``call`` as non-contiguous (b, h, s, d) views of (b, s, h·d) projections."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def proj(seq: int) -> torch.Tensor:
        x = torch.randn(call.b, seq, call.heads * call.head_dim, generator=gen, dtype=torch.float32)
        x = x.to(device=device, dtype=dtype)
        return x.view(call.b, seq, call.heads, call.head_dim).transpose(1, 2)

    return proj(call.q_len), proj(call.kv_len), proj(call.kv_len)


def sample_rows(q_len: int, n: int = ERROR_ROWS) -> torch.Tensor:
    """Evenly spaced query rows, first and last included (all rows when q_len ≤ n)."""
    if q_len <= n:
        return torch.arange(q_len)
    return torch.linspace(0, q_len - 1, n).round().long().unique()


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """float64 softmax(q kᵀ/√d) v for the given query rows, on q's device."""
    qd = q[:, :, rows.to(q.device), :].double()
    scores = (qd @ k.double().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    return scores.softmax(dim=-1) @ v.double()


def output_error(out: torch.Tensor, rows: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(relative L2 error, max abs error) of ``out`` on ``rows`` against ``ref``."""
    diff = out[:, :, rows.to(out.device), :].double() - ref
    rel = (diff.norm() / ref.norm()).item()
    return rel, diff.abs().max().item()
