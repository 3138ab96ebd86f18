"""Sparse attention for long self-attention calls, held to an error budget the user sets.

``settings``: what the user sets (``lib_attn.configure(sparse=...)``): the method (a sparse backend,
``lib_attn.kernels.sparse``), the error budget, the minimum tokens, the routing knob and the dense
windows.
"""
from .settings import (AUTO, DEFAULT_BUDGET, DEFAULT_DENSE, DEFAULT_MIN_TOKENS, DEFAULT_TOPK, EXAMPLE, Sparse,
                       SparseError, make, methods, parse)

__all__ = ["AUTO", "DEFAULT_BUDGET", "DEFAULT_DENSE", "DEFAULT_MIN_TOKENS", "DEFAULT_TOPK", "EXAMPLE", "Sparse",
           "SparseError", "make", "methods", "parse"]
