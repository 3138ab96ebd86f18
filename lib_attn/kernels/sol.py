"""Sol-Attn, comfy-kitchen's training-free sparse attention, through its public ``comfy_kitchen.sol_attn``.

Facts from comfy-kitchen 0.2.40's released Python (``__init__.py``, ``backends/cuda``, ``backends/eager/
sol_attn.py``, ``constraints.py``):

* ``sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None, topk_ratio=0.0,
  ...)`` takes q, k, v of one shape (B, T, H, 128) and one dtype, and returns (B, T, H, 128) contiguous.
  Each 64-token query block attends a routed subset of key blocks exactly and every other key block
  through one pooled term (mean key, summed values), so the whole sequence stays in the softmax
  denominator. Routing: a key block is exact when its score against the query block's centroid clears
  ``tau`` sigmas of that row's spread (higher ``tau``: fewer blocks), or, with ``topk_ratio > 0``, when it
  is among the ``topk_ratio`` share of the row's other blocks (the sinks neither count toward nor use
  that share); the diagonal block and its neighbours and the ``sink_blocks`` ``[start, end)`` are always
  exact, and the query blocks ``sink_q`` ``[start, end)`` attend every key block exactly. The engine
  passes a joint call's conditioning tokens' blocks as both (``lib_attn.conditioning``).
* ``sol_attn_is_available(device)``: its compiled kernels, CUDA on sm80 and newer (the CUDA entry
  raises below sm80: "sub-sm_80 cubins return garbage") or the HIP build on AMD GPUs with WMMA matrix
  cores (RDNA3 and newer); bf16/fp16, 16-byte aligned tensors whose strides are multiples of 8.
* Anywhere else the call runs the eager reference, which computes every score in fp32 (O(T²) memory,
  refused past 4 GiB of scores): a check of the algorithm, slower than dense attention. The engine runs
  it only when the user names ``sol`` (for checking), never under ``auto``.

The share of blocks a call computes is not returned by ``sol_attn``; ``routed_share`` computes it, for
the calls the engine measures only and a chunk of blocks at a time (no fp32 copy of q or k), from the
same block means and the same rule (the reference's routing; the compiled kernels route on INT8
scores and may differ at the margin).
"""
from __future__ import annotations

import math

import torch

from .. import conditioning
from ..spec import HALF, CallSpec
from .base import Status, default_scale
from .kitchen import DIST, MATRIX_CORE_ARCHS, load
from .sparse import Knob, SparseBackend, SparseResult

HEAD_DIM = 128
BLOCK = 64
MIN_SM = 80
#: The eager reference's own limit on its fp32 score tensor.
EAGER_SCORE_BYTES = 4 * 2**30
#: ComfyUI core's Model Sparse Attention node's default tau.
DEFAULT_TAU = 1.3
LOG2E = 1.4426950408889634

#: Why the kernel hub does not serve Sol-Attn here.
HUB_REASON = ("no kernel hub build of Sol-Attn is known to the engine; comfy-kitchen's wheel carries it (compiled "
              "for NVIDIA Ampere and newer and AMD RDNA3 and newer; elsewhere an eager reference, slower than dense)")

def sink_blocks(seq_len: int) -> list[int] | None:
    """The 64-token blocks ``[start, end)`` that hold the conditioning tokens of a call over ``seq_len``
    tokens (``lib_attn.conditioning``), first or last, or None: Sol-Attn's ``sink_blocks`` (every query
    attends them exactly) and ``sink_q`` (they attend every key exactly)."""
    found = conditioning.current_blocks(seq_len, BLOCK)
    return None if found is None else list(found)


def _topk_blocks(n: int, ratio: float) -> int:
    return max(0, min(n - 1, max(1, round(ratio * n))))


#: Block-mean scores routed at once (heads are taken in groups of about this many N x N scores).
ROUTING_CHUNK = 2**24
#: Bytes of an input cast to fp32 at once for its block means (a chunk of blocks at a time).
MEANS_CHUNK_BYTES = 16 * 2**20


def _block_means(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, D) fp32 means over 64-token blocks (the last one over its own tokens),
    a chunk of blocks at a time: no fp32 copy of ``x``, only of one chunk (``MEANS_CHUNK_BYTES``)."""
    b, t, h, d = x.shape
    n = math.ceil(t / BLOCK)
    full = t // BLOCK
    out = torch.empty((b, n, h, d), dtype=torch.float32, device=x.device)
    step = max(1, MEANS_CHUNK_BYTES // (BLOCK * b * h * d * 4))
    for start in range(0, full, step):
        stop = min(full, start + step)
        out[:, start:stop] = x[:, start * BLOCK:stop * BLOCK].unflatten(1, (stop - start, BLOCK)).float().mean(2)
    if full < n:
        out[:, full] = x[:, full * BLOCK:].float().mean(1)
    return out.transpose(1, 2)


def routed_blocks(qm, km, scale: float, knob: Knob, sinks: list[int] | None) -> torch.Tensor:
    """Which key blocks each query block computes exactly, (B, H, N, N) bool, from block means (B, H, N, D)
    of q and k by the reference's rule: the diagonal and its neighbours and the sinks always (as key
    blocks, and as query blocks over every key: ``sink_q``, which the engine passes equal to the sinks);
    the rest by ``tau`` sigmas of the row's spread, or the ``topk`` share of the row's other blocks."""
    n = qm.shape[2]
    kc = km - km.mean(2, keepdim=True)  # a shift of every score in a row: routing is unchanged by it
    log2s = scale * LOG2E
    scores = (qm @ kc.transpose(-1, -2)) * log2s
    idx = torch.arange(n, device=qm.device)
    s0, s1 = sinks or (0, 0)
    sink = (idx >= s0) & (idx < s1)
    if knob.name == "topk":
        ranked = scores.masked_fill(sink, float("-inf"))
        kk = _topk_blocks(n - int(sink.sum()), knob.value)
        exact = (ranked >= ranked.topk(kk, dim=-1).values[..., -1:]) if kk else torch.zeros_like(sink).expand_as(scores)
    else:
        spread = (qm.pow(2) * kc.pow(2).mean(2, keepdim=True)).sum(-1, keepdim=True)
        exact = scores > knob.value * torch.sqrt(spread * log2s * log2s + 1e-6)
    return exact | ((idx.view(-1, 1) - idx.view(1, -1)).abs() <= 1) | sink | sink.view(-1, 1)


def routed_share(q, k, scale: float, knob: Knob, sinks: list[int] | None) -> torch.Tensor:
    """The share of (query block, key block) pairs Sol-Attn computes exactly for q, k (B, T, H, D), a 0-d
    fp32 tensor; a few heads at a time, so its scores stay near ``ROUTING_CHUNK`` elements."""
    with torch.no_grad():
        qm, km = _block_means(q), _block_means(k)
        b, h, n, _ = qm.shape
        step = max(1, ROUTING_CHUNK // (b * n * n))
        kept = sum(routed_blocks(qm[:, i:i + step], km[:, i:i + step], scale, knob, sinks).sum(dtype=torch.float32)
                   for i in range(0, h, step))
        return kept / (b * h * n * n)


class Sol(SparseBackend):
    """Sol-Attn (``comfy_kitchen.sol_attn``): a threshold ``tau`` or a top-k share of key blocks."""

    id = "sol"
    label = "Sol-Attn (comfy-kitchen; routed key blocks exact, the rest pooled)"
    packages = (DIST,)
    layout = "bshd"
    devices = ("cuda", "cpu")
    dtypes = HALF + (torch.float32,)
    block = BLOCK
    knobs = ("threshold", "topk")
    default_knob = Knob("threshold", DEFAULT_TAU)
    threshold_text = "tau: a key block is exact when its pooled score clears tau sigmas of the row; higher is sparser"
    threshold_range = (0.0, 4.0)
    threshold_denser = False
    #: tau values calibration may try, in ascending order (from a sparser tau it goes down this list).
    threshold_ladder = (0.0, 0.25, 0.5, 0.75, 1.0, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0)

    def __init__(self):
        self.fn = None
        self.compiled = None
        self.extension_error = ""
        self._compiled_on = {}

    def _probe(self) -> Status:
        self.fn = self.compiled = None
        self.extension_error, self._compiled_on = "", {}
        try:
            package, version, error = load()
        except ImportError as exc:
            raise type(exc)(f"{exc}; hub: {HUB_REASON}") from exc
        fn = getattr(package, "sol_attn", None)
        if fn is None:
            return Status(False, f"comfy-kitchen {version} has no sol_attn (0.2.40 has)", version)
        # Without its compiled kernels sol_attn runs the eager reference (every score in fp32, slower than
        # dense): a GPU call goes to it only when Sol is named (see ``compiled_reasons``).
        self.fn, self.compiled, self.extension_error = fn, package.sol_attn_is_available, error
        return Status(True, version=version)

    def compiled_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        """Why a GPU call would reach the eager reference (the package's own answer for the device), or
        when Sol is named, why the eager reference cannot take it."""
        if self.compiled is None or spec.device.type != "cuda":
            return []
        index = spec.device.index or 0
        if index not in self._compiled_on:
            self._compiled_on[index] = bool(self.compiled(torch.device(spec.device.type, index)))
        if self._compiled_on[index]:
            return []
        if asked:
            return self.eager_limit_reasons(spec)
        cuda_error = self.extension_error if spec.device.platform == "cuda" else ""
        why = f"its compiled extension did not load: {cuda_error}" if cuda_error else \
            "sol_attn_is_available() is False"
        return [f"no compiled Sol-Attn kernels on this device ({why}): the eager reference (slower than dense "
                f"attention) runs only when named"]

    def takes_dtype(self, dtype: torch.dtype, device: str) -> bool:
        # The compiled kernels take bf16/fp16; the eager reference computes in fp32 whatever it is given.
        return dtype in (self.dtypes if device == "cpu" else HALF)

    def reasons(self, spec: CallSpec, asked: bool = False) -> list[str]:
        out = super().reasons(spec, asked)
        if spec.device.type == "cpu" and not out:
            out += self.eager_reasons(spec, asked)
        return out

    def eager_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        if not asked:
            return ["cpu: Sol-Attn runs its eager reference here (every score in fp32, slower than dense "
                    "attention): only when named, for checking"]
        return self.eager_limit_reasons(spec)

    @staticmethod
    def eager_limit_reasons(spec: CallSpec) -> list[str]:
        scores = spec.batch * spec.heads * spec.q_len * spec.kv_len * 4
        if scores > EAGER_SCORE_BYTES:
            return [f"{spec.device.type}: Sol-Attn's eager reference would hold {scores / 2**30:.1f} GiB of scores "
                    f"(its limit: {EAGER_SCORE_BYTES / 2**30:.0f} GiB)"]
        return []

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = self._shape_reasons(spec)
        if spec.device.type == "cuda" and (spec.device.sm or 0) < MIN_SM:
            out.append(f"GPU sm{spec.device.sm} < sm{MIN_SM} (Sol-Attn's compiled kernels)")
        return out or self.compiled_reasons(spec, asked)

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = self._shape_reasons(spec)
        arch = spec.device.arch or "AMD GPU"
        if not arch.startswith(MATRIX_CORE_ARCHS):
            out.append(f"{arch}: Sol-Attn's HIP kernels need WMMA matrix cores (RDNA3 or newer: gfx11xx, gfx12xx)")
        return out or self.compiled_reasons(spec, asked)

    @staticmethod
    def _shape_reasons(spec: CallSpec) -> list[str]:
        out = []
        if spec.head_dim != HEAD_DIM:
            out.append(f"head_dim {spec.head_dim} != {HEAD_DIM} (Sol-Attn's kernels are built for {HEAD_DIM})")
        if spec.q_len != spec.kv_len:
            out.append(f"q_len {spec.q_len} != kv_len {spec.kv_len} (Sol-Attn takes self-attention)")
        return out

    def arguments(self, t: int, knob: Knob) -> dict:
        """``sol_attn``'s routing arguments for ``knob`` on a sequence of ``t`` tokens: the conditioning
        tokens' blocks as sinks, keys every query attends and queries attending every key."""
        sinks = sink_blocks(t)
        args = {"sink_blocks": sinks, "sink_q": sinks}
        if knob.name == "topk":
            args["topk_ratio"] = float(knob.value)
        else:
            args["tau"] = float(knob.value)
        return args

    def run_sparse(self, q, k, v, scale, knob: Knob) -> SparseResult:
        q, k, v = (_aligned(x) for x in (q, k, v))
        args = self.arguments(q.shape[1], knob)
        out = self.fn(q, k, v, scale=scale, **args)
        sinks, scale = args["sink_blocks"], default_scale(scale, q.shape[-1])
        # the share of blocks computed, only for the calls the engine measures
        return SparseResult(out, None, lambda: routed_share(q, k, scale, knob, sinks))


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x as the compiled kernels load it: unit last stride, a 16-byte aligned start and the other strides
    multiples of 8 elements (their 16-byte staging loads); otherwise a contiguous copy."""
    ok = (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
          and all(x.stride(i) % 8 == 0 for i in range(3) if x.shape[i] > 1))
    return x if ok else x.contiguous()
