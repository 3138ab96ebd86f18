"""Backends registered by the tuning tests: each counts its calls in ``CALLS``.

``tt-quick`` and ``tt-slow`` are correct (``tt-slow`` sleeps first); ``tt-wrong`` is fast and wrong;
``tt-raise`` raises. Importable from a subprocess, which prints what ran.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.nn.functional as F

import lib_attn

CALLS: Counter = Counter()
IDS = ("tt-slow", "tt-wrong", "tt-raise", "tt-quick")


class _Counted(lib_attn.Backend):
    devices = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)


class Quick(_Counted):
    id, label = "tt-quick", "correct"

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class Slow(_Counted):
    id, label = "tt-slow", "correct, slow"

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        time.sleep(0.004)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class Wrong(_Counted):
    id, label = "tt-wrong", "fast, wrong"

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        return v[:, :, :1].expand(q.shape[:-1] + (v.shape[-1],))


class Raises(_Counted):
    id, label = "tt-raise", "raises"

    def run(self, q, k, v, mask, scale):
        CALLS[self.id] += 1
        raise RuntimeError("no kernel image for this device\nsecond line")


def register() -> None:
    for backend in (Slow(), Wrong(), Raises(), Quick()):
        lib_attn.register_backend(backend)
    CALLS.clear()


def unregister() -> None:
    for bid in IDS:
        lib_attn.unregister_backend(bid)


if __name__ == "__main__":  # one process of the "kept across runs" test
    import json

    register()
    lib_attn.configure(preference=list(IDS), tune="on")
    q = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    lib_attn.attention(q, q, q)
    d = lib_attn.explain(q, q, q)
    print(json.dumps({"calls": dict(CALLS), "source": d.source, "backend": d.backend}))
