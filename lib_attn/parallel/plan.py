"""What a parallel call sends, on paper: the bytes one rank sends per call and per step, from the same
rules the collectives follow (``modes``), so the readout's measured bytes and these agree for even
splits. Used by ``python -m lib_attn parallel`` and for the planning table in docs/parallel.md.

For a call of batch b, H heads (padded up to a multiple of U), N split tokens, T text tokens (joint
calls), head size d and e bytes per element, on W = U x R ranks, one rank sends:

* Ulysses: q, k, v of its N/W tokens to the U-1 others of its group, (U-1)/U of them each way, and the
  output back: 4 (U-1) b (H/U) (N/W) d e; a joint call adds the all-gather of the text output's
  heads, (U-1) b (H/U) T d e.
* Ring: its block's keys and values, N/R tokens of H/U heads, on each of R-1 steps:
  2 (R-1) b (H/U) (N/R) d e; a joint call adds the all-gather of the text output's rows, each rank's
  share of them (ceil(T/R), the longest) to the R-1 others: (R-1) b (H/U) ceil(T/R) d e.
* A cross call (keys and values on every rank): nothing.
"""
from __future__ import annotations

import math

from .mesh import degrees


def call_bytes(b: int, heads: int, n: int, d: int, element: int, world: int, ulysses: int | None = None,
               ring: int | None = None, text: int = 0, kind: str = "self") -> dict:
    """{"ulysses": bytes, "ring": bytes, "total": bytes} one rank sends for one call (even split)."""
    u, r = degrees(world, ulysses, ring)
    if kind == "cross" or world == 1:
        return {"ulysses": 0, "ring": 0, "total": 0}
    hp = math.ceil(heads / u)
    per_rank = n / world
    a2a = 4 * (u - 1) * b * hp * per_rank * d * element
    if kind == "joint":
        a2a += (u - 1) * b * hp * text * d * element
    ring_bytes = 2 * (r - 1) * b * hp * (n / r) * d * element
    if kind == "joint":
        ring_bytes += (r - 1) * b * hp * math.ceil(text / r) * d * element
    return {"ulysses": round(a2a), "ring": round(ring_bytes), "total": round(a2a + ring_bytes)}


def model_step_bytes(calls, world: int, ulysses: int | None = None, ring: int | None = None,
                     element: int = 2) -> dict:
    """Bytes one rank sends per denoising step for ``calls`` (``lib_attn.shapes.AttentionCall`` items,
    their text tokens taken from the model's spec): {"per_call": [(call, bytes)], "step": bytes}."""
    from .. import shapes

    rows, total = [], 0
    for call in calls:
        spec = shapes.SPECS[call.model]
        text = getattr(spec, "text_tokens", 0) if call.kind == "self" and getattr(spec, "joint", True) else 0
        kind = "cross" if call.kind == "cross" else ("joint" if text else "self")
        n = call.q_len - text
        sent = call_bytes(call.b, call.heads, n, call.head_dim, element, world, ulysses, ring, text, kind)["total"]
        rows.append((call, kind, sent))
        total += sent * call.calls
    return {"per_call": rows, "step": total}
