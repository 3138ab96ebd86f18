"""Which backends are tried for a call, in order: the default chain per device and role, the chain
in force once the configuration (and a per-call backend) is applied, and the backends tuning ranks.

The default chains come from published kernel measurements (see docs/kernels.md); the last entry of
every chain is ``math``, which takes every valid call.
"""
from __future__ import annotations

import torch

from . import _compat
from . import tune as _tune
from .device import DeviceInfo
from .kernels import REGISTRY, status
from .kernels.flash import CK_ARCHS, TRITON_ARCH_PREFIXES
from .spec import CallSpec


#: Default chains, fastest first, from published kernel measurements (see docs/kernels.md). The last
#: entry of every chain is ``math``, which takes every valid call.
_HOPPER_FIRST = ("sdpa-cudnn", "sdpa-flash", "xformers", "sdpa-efficient", "sdpa")
_AMPERE_FIRST = ("sdpa-flash", "sdpa-cudnn", "xformers", "sdpa-efficient", "sdpa")
_OLDER_GPU = ("xformers", "sdpa-efficient", "sdpa")
_GPU_VAE = ("sdpa-efficient", "xformers", "sdpa")
_OTHER_DEVICE = ("sdpa",)


#: PyTorch prefers cuDNN attention on Hopper/Blackwell-datacenter only from cuDNN 9.15.1, which fixed
#: sequence lengths that are not multiples of 128 (SD's 77-key cross-attention is one).
CUDNN_FIRST_FROM = 91501


#: Fused kernels first on an AMD GPU whose torch has AOTriton kernels for it (MI200/MI300, RDNA3/4):
#: flash-attn (its CK or Triton build) then PyTorch's AOTriton flash and memory-efficient kernels. cuDNN
#: does not exist there, and xformers' CK kernels are left to the user's choice (no published figure has
#: them ahead of AOTriton for these shapes).
_ROCM_FUSED = ("flash-attn", "sdpa-flash", "sdpa-efficient")
#: Above this many bytes of (b, h, q, kv) scores in the call's dtype, a call on a device with no fused
#: kernel for it runs on the bounded ``math`` path instead of a full-matrix kernel. At this size the full
#: matrix and its softmax hold >= 512 MiB at once (PyTorch's ROCm math path and MPS's sdpa_general_mps
#: both materialise them), which on an 8-16 GiB card or Mac sits on top of the model's own weights and
#: activations. The bounded path holds one 16 MiB score chunk at a time: measured on CPU (docs/kernels.md),
#: 73 MiB for the VAE's 1024x1024 call and 72 MiB for SDXL's largest, output included, against 2.3 and
#: 2.9 GiB for PyTorch's full-matrix math kernel. In fp16, cross-attention, the lower UNet levels,
#: SDXL at 768x768, SD3 and Flux at 512x512 and the VAE up to 768x768 stay below it; the top UNet level
#: of SD1.5 at 512x512 (2 x 8 x 4096 x 4096 scores, 512 MiB), SDXL at 1024x1024 (640 MiB), SD3 and
#: Flux from 768x768 and the VAE at 1024x1024 (16384 x 16384, 512 MiB) are above it.
FULL_MATRIX_MAX_BYTES = 256 * 2**20


def score_bytes(spec: CallSpec) -> int:
    """Bytes of the call's full (b, h, q, kv) score matrix in its dtype."""
    return spec.batch * spec.heads * spec.q_len * spec.kv_len * (torch.finfo(spec.dtype).bits // 8)


def _rocm_chain(role: str, device: DeviceInfo, spec: CallSpec | None) -> tuple:
    """An AMD GPU: fused kernels where this torch (or flash-attn) has them; where none is, PyTorch's
    ``sdpa`` (its math kernel, a full score matrix) only for calls whose matrix is small."""
    # A large call no fused kernel takes (the VAE's head_dim 512 before AOTriton 0.9, or any call while
    # the experimental switch is off) goes to the bounded path: PyTorch's own choice would be the full matrix.
    tail = () if spec is not None and score_bytes(spec) > FULL_MATRIX_MAX_BYTES else ("sdpa",)
    first = _compat.AOTRITON_FIRST_TORCH.get(device.arch)
    if first is not None and _compat.TORCH_VERSION >= first:
        return _ROCM_FUSED + tail  # behind the experimental switch too: their reasons name it
    flash = ("flash-attn",) if device.arch.startswith(TRITON_ARCH_PREFIXES) or device.arch in CK_ARCHS else ()
    return flash + tail


def default_chain(role: str, device: DeviceInfo, fa3: bool | None = None, cudnn: int | None = -1,
                  spec: CallSpec | None = None) -> tuple:
    """The backends tried for ``role`` on ``device`` when the user chose none, in order.

    On Hopper (and sm10x) with a recent cuDNN, cuDNN and FlashAttention-3 are the fastest fused
    kernels, so cuDNN leads there, after flash-attn only when its FA3 build is installed (``fa3``;
    looked up when None). ``cudnn`` is the cuDNN version as torch reports it (looked up when -1).
    Elsewhere (Ampere, Ada, consumer Blackwell) flash-attn and PyTorch's flash kernel lead.
    SageAttention is never in a default chain: it is opt-in, because its 8-bit QK^T changes images
    on some models.

    On ROCm and MPS the chain also depends on the call's size (``spec``, from the call's metadata, so
    decided once per signature): see ``_rocm_chain`` and ``FULL_MATRIX_MAX_BYTES``. On MPS PyTorch's
    SDPA (``sdpa_general_mps``: matmul, softmax, matmul, all in MPSGraph; no fused kernel for
    these shapes) takes calls whose score matrix is at most that size, and the bounded path the rest:
    above it the matrix grows toward MPSGraph's 2**32-byte array limit (pytorch issue 149261) and its
    2**32-element indexing fault (pytorch issue 179352). Without ``spec`` the chain for a small call.
    """
    major = device.capability[0] if device.capability else 0
    if device.platform == "rocm":
        chain = _rocm_chain(role, device, spec)
    elif device.platform == "mps":
        chain = () if spec is not None and score_bytes(spec) > FULL_MATRIX_MAX_BYTES else _OTHER_DEVICE
    elif device.type != "cuda":
        chain = _OTHER_DEVICE
    elif role == "vae":
        chain = _GPU_VAE
    elif major in (9, 10) and (torch.backends.cudnn.version() if cudnn == -1 else cudnn or 0) >= CUDNN_FIRST_FROM:
        if fa3 is None:
            fa3 = status("flash-attn").available and REGISTRY["flash-attn"].fa3 is not None
        chain = ("flash-attn",) + _HOPPER_FIRST if fa3 else _HOPPER_FIRST[:1] + ("flash-attn",) + _HOPPER_FIRST[1:]
    elif major >= 8:
        chain = ("flash-attn",) + _AMPERE_FIRST
    else:
        chain = _OLDER_GPU
    return chain + ("math",)


def _dedupe(ids) -> tuple:
    seen: dict = {}
    for i in ids:
        seen.setdefault(i, None)
    return tuple(seen)


def chain_for(role: str, device: DeviceInfo, backend: str | None, cfg, spec: CallSpec | None = None) -> tuple[tuple, bool]:
    """The chain for one call and whether its head was named by the user (per call or configured)."""
    explicit = cfg.preference.get(role)
    head = ((backend,) if backend else ()) + (explicit or ())
    return _dedupe(head + _default(role, device, cfg, spec)), bool(head)


def _default(role: str, device: DeviceInfo, cfg, spec: CallSpec | None) -> tuple:
    """The default chain without the backends the configuration avoids."""
    chain = default_chain(role, device, spec=spec)
    return tuple(b for b in chain if b not in cfg.avoid) if cfg.avoid else chain


def tuning_chain(role: str, device: DeviceInfo, backend: str | None, cfg, spec: CallSpec | None = None) -> tuple | None:
    """The backends ranked for a call when tuning applies, else None.

    Under Auto, the default chain (never an ``approximate`` backend: those are ranked only where the
    user's chain names them); the user's own chain when it names more than one backend. A single
    named backend (per call or configured) is never second-guessed.
    """
    if backend is not None or not _tune.enabled(cfg.tune, device.type):
        return None
    named = cfg.preference.get(role)
    if named:
        return named if len(named) > 1 else None
    return tuple(b for b in _default(role, device, cfg, spec) if not REGISTRY[b].approximate)
