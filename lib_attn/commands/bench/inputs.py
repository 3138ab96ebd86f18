"""The bench's inputs and their reference: seeded random q, k, v laid out as A1111 passes them
(``(b, s, h·d)`` projections viewed as ``(b, s, h, d)`` and transposed to ``(b, h, s, d)``, so not
contiguous), and the float64 result on evenly spaced query rows that each output is checked against."""
from __future__ import annotations

import math
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


def grid_coords(grid: Tuple[int, ...]):
    """(tokens, their coordinates on ``grid`` as an (n, len(grid)) float64 tensor), in row-major order."""
    n = math.prod(grid)
    coords = torch.stack(torch.meshgrid(*[torch.arange(size, dtype=torch.float64) for size in grid], indexing="ij"),
                         dim=-1).reshape(n, len(grid))
    return n, coords


def local_inputs(b: int, heads: int, grid: Tuple[int, ...], head_dim: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0, strength: float = 0.7):
    """q, k, v whose attention is local, as a video model's is: each token's q and k hold the same
    smooth function of its position on ``grid`` ((frames, height, width), or (tokens,) for a sequence),
    plus independent noise of the same size, so scores are highest between neighbours and fall off
    with distance along every axis. The position part is a sum of cosines and sines of each coordinate
    at wavelengths from 2 to about the axis' length; ``strength`` scales it (0: plain random inputs).
    Returned as (b, heads, tokens, head_dim) non-contiguous views, as ``make_inputs``'s."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, coords = grid_coords(grid)
    per_axis = max(1, head_dim // (2 * len(grid)))
    features = []
    for axis, size in enumerate(grid):
        waves = torch.logspace(0, max(0.0, torch.tensor(float(size)).log10().item()), per_axis, dtype=torch.float64)
        angle = coords[:, axis:axis + 1] * (2 * torch.pi / (2 * waves))
        features += [angle.cos(), angle.sin()]
    position = torch.cat(features, dim=1)[:, :head_dim]
    position = torch.nn.functional.pad(position, (0, head_dim - position.shape[1]))
    # each feature pair contributes cos(Δ·ω) to q·k; scaled so that neighbours' scores stand out by a
    # few units after the 1/sqrt(d) scale
    position = position * (strength * head_dim ** 0.5 / position.shape[1] ** 0.5 * 3.0)

    def proj(with_position: bool) -> torch.Tensor:
        x = torch.randn(b, n, heads, head_dim, generator=gen, dtype=torch.float64)
        if with_position:
            x = x + position[None, :, None, :]
        return x.to(device=device, dtype=dtype).transpose(1, 2)

    return proj(True), proj(True), proj(False)


def rope_inputs(b: int, heads: int, grid: Tuple[int, ...], head_dim: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0, strength: float = 1.0, noise: float = 0.3):
    """q, k, v of a model whose q and k projections leave only RoPE's position term, as in a video DiT
    (Wan's 3-D RoPE: the head dim split over the (frames, height, width) axes, each pair of channels
    rotated by its coordinate times a frequency, wavelengths from 2 tokens to twice the axis' length): q and k are one vector per
    head, rotated by each token's place, plus ``noise`` of it at random; v is random. Scores depend on
    the offset between two tokens, highest between neighbours, as a trained model's local heads'.
    ``strength`` scales q (the scores' sharpness). Returned as (b, heads, tokens, head_dim) views."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, coords = grid_coords(grid)
    pairs = head_dim // 2
    split = [pairs // len(grid) + (1 if i < pairs % len(grid) else 0) for i in range(len(grid))]
    # wavelengths from 2 tokens to twice the axis' length, log-spaced (RoPE's span, fitted to the grid)
    angles = torch.cat([coords[:, axis:axis + 1] * (2 * torch.pi / torch.logspace(
        math.log10(2), math.log10(max(2 * size, 2)), m, dtype=torch.float64)) for axis, (m, size) in
        enumerate(zip(split, grid))], dim=1)  # (n, pairs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    def rotated(base):
        x = base.expand(b, n, heads, head_dim)
        x = x + noise * torch.randn(b, n, heads, head_dim, generator=gen, dtype=torch.float64)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    base = torch.randn(1, 1, heads, head_dim, generator=gen, dtype=torch.float64)
    base = base / base.norm(dim=-1, keepdim=True) * (head_dim ** 0.5) * (strength * 2.0) ** 0.5
    q, k = rotated(base), rotated(base)
    v = torch.randn(b, n, heads, head_dim, generator=gen, dtype=torch.float64)
    return tuple(x.to(device=device, dtype=dtype).transpose(1, 2) for x in (q, k, v))
