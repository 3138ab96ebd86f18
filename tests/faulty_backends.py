"""Faulty kernels for the guard's tests, registered through ``lib_attn.register_backend``.

Each computes PyTorch's SDPA and then spoils it in one way: ``fk-nan`` returns NaN on every call,
``fk-nan3`` on every third call (an approximate kernel, as the quantised ones that fail on some
inputs are), ``fk-drift`` is 10% off, ``fk-shape`` drops the last query row, ``fk-writes`` returns
the right answer but zeroes its v, ``fk-writes-long`` does so only on calls of more than
``LONG`` queries (a write that a short probe cannot show), and ``fk-scale-long``, ``fk-sign-long``
and ``fk-trade-long`` scale q by 1/8, flip its sign, or double q and halve k in place on those calls
(writes a wrapping sum of fp32 bits adds up to nothing). ``CALLS`` counts the calls of each, and
``SEEN`` lists the storage of the q, k and v each call was given.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

import lib_attn

CALLS: Counter = Counter()
SEEN: dict = {}
LONG = 1000


class _Faulty(lib_attn.Backend):
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        SEEN.setdefault(self.id, []).append(tuple(t.untyped_storage().data_ptr() for t in (q, k, v)))
        return self.spoil(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), q, k, v)

    def spoil(self, out, q, k, v):
        raise NotImplementedError


class NaNAlways(_Faulty):
    id, label = "fk-nan", "NaN always"

    def spoil(self, out, q, k, v):
        return torch.full_like(out, float("nan"))


class NaNEveryThird(_Faulty):
    id, label, approximate = "fk-nan3", "NaN on every third call", True

    def spoil(self, out, q, k, v):
        return out.fill_(float("nan")) if CALLS[self.id] % 3 == 0 else out


class Drift(_Faulty):
    id, label = "fk-drift", "10% drift"

    def spoil(self, out, q, k, v):
        return out * 1.1


class WrongShape(_Faulty):
    id, label = "fk-shape", "wrong shape"

    def spoil(self, out, q, k, v):
        return out[:, :, :-1]


class WritesInputs(_Faulty):
    id, label = "fk-writes", "writes into its inputs"

    def spoil(self, out, q, k, v):
        v.zero_()
        return out


class WritesInputsWhenLong(_Faulty):
    id, label = "fk-writes-long", "writes into its inputs on long calls"

    def spoil(self, out, q, k, v):
        if q.shape[2] > LONG:
            v.zero_()
        return out


class _WritesWhenLong(_Faulty):
    """Right output (computed in fp32 from the inputs as given), then an in-place change of its inputs
    that leaves every word a multiple of a large power of two away from what it was, on long calls."""

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        SEEN.setdefault(self.id, []).append(tuple(t.untyped_storage().data_ptr() for t in (q, k, v)))
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
        if q.shape[2] > LONG:
            self.write(q, k)
        return out.to(q.dtype)


class ScalesQWhenLong(_WritesWhenLong):
    id, label = "fk-scale-long", "pre-scales q in place by 1/8 on long calls"

    def write(self, q, k):
        q.mul_(0.125)


class FlipsQWhenLong(_WritesWhenLong):
    id, label = "fk-sign-long", "flips q's sign in place on long calls"

    def write(self, q, k):
        q.neg_()


class TradesQKWhenLong(_WritesWhenLong):
    id, label = "fk-trade-long", "doubles q and halves k in place on long calls (the scores stay the same)"

    def write(self, q, k):
        q.mul_(2)
        k.mul_(0.5)


LONG_WRITERS = (WritesInputsWhenLong, ScalesQWhenLong, FlipsQWhenLong, TradesQKWhenLong)

#: Faulty on every call kind (``fk-writes-long`` is right on short calls, and registered beside them).
BACKENDS = (NaNAlways, NaNEveryThird, Drift, WrongShape, WritesInputs)
IDS = tuple(b.id for b in BACKENDS)


def register() -> None:
    for backend in BACKENDS + LONG_WRITERS:
        lib_attn.register_backend(backend())
    CALLS.clear()
    SEEN.clear()


def unregister() -> None:
    for bid in IDS + tuple(b.id for b in LONG_WRITERS):
        lib_attn.unregister_backend(bid)
