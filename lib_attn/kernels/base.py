"""What every backend is: an id, a one-time probe, per-call reasons, and a kernel call.

A backend never raises to say no: ``reasons(spec)`` lists what the call has against what the kernel
needs, as "what you have vs what is needed" strings, and an empty list means it can take the call.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..spec import DENSE, FLOATS, HALF, KEY_PADDING, NO_MASK, CallSpec

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class Status:
    """The one-time probe: installed and loadable, or the reason (the import error's own text)."""

    available: bool
    reason: str = ""
    version: str = ""


def release(version: str) -> tuple[int, int, int]:
    """A package's release from its version text: ``2.2.0.post2+cu128torch2.8`` -> (2, 2, 0); (0, 0, 0)
    when it has no leading number (a source checkout, a hub build)."""
    numbers = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version or "")
    return tuple(int(n or 0) for n in numbers.groups()) if numbers else (0, 0, 0)


def failure_text(exc: BaseException) -> str:
    """An exception as a one-line reason: type and first line of the message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


#: Errors after which the CUDA context is unusable: re-raised, never a reason to try another backend.
STICKY_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address")


def is_sticky(exc: BaseException) -> bool:
    return any(s in str(exc) for s in STICKY_ERRORS)


def new_output(shape, dtype, device) -> torch.Tensor:
    """Allocate an output a backend fills piece by piece (tests poison it through this one place)."""
    return torch.empty(shape, dtype=dtype, device=device)


def last_dim_contiguous(*tensors):
    """Kernels called below PyTorch's own entry point need unit stride along head_dim."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def default_scale(scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """A mask broadcastable to (b, h, q, kv) with its missing leading dimensions added as size 1."""
    return mask if mask.dim() == 4 else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def additive_bias(mask: torch.Tensor, dtype: torch.dtype, shape: tuple, align: int = 1,
                  neg: float = float("-inf")) -> torch.Tensor:
    """The mask as an additive float bias viewed as ``shape`` = (b, h, q, kv).

    The bias keeps the mask's own size along broadcast dimensions (expanded with stride 0), so a
    key-padding mask stays one row per batch item. Fused kernels read it with vector loads: its last
    dimension must be unit-stride and every other stride a multiple of ``align``, so when it is not,
    it lives in a buffer padded to a multiple of ``align`` and is returned as a view. A bool mask
    becomes 0 / ``neg`` (cuDNN wants a finite ``neg``).
    """
    m = as_4d(mask)
    if m.dtype == torch.bool:
        bias = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, neg)
    else:
        bias = m.to(dtype)
    kv = shape[-1]
    if bias.shape[-1] != kv:  # a mask that broadcasts over the keys
        bias = bias.expand(tuple(bias.shape[:-1]) + (kv,))
    if align > 1 and (kv % align or bias.stride(-1) != 1 or any(st % align for st in bias.stride()[:-1])):
        padded = torch.empty(tuple(bias.shape[:-1]) + (kv + (-kv) % align,), dtype=dtype, device=m.device)
        padded[..., :kv] = bias
        bias = padded[..., :kv]
    return bias.expand(shape)


def needs_grad(q, k, v, mask=None) -> bool:
    """The call's output needs an autograd graph: grad mode is on and q, k, v or a float mask (a
    learned bias) require grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (mask is not None and mask.requires_grad))


#: Why an approximate kernel does not take a call that asks for exact attention.
EXACT_ASKED = "approximate kernel: the call asks for exact attention"


class Backend:
    """Base class of every backend, built-in or added with ``lib_attn.register_backend``.

    A subclass sets ``id`` (a stable name used in chains, flags and settings), ``label``, ``devices``
    (device types, e.g. ``("cuda", "cpu")``), ``dtypes`` (torch dtypes it computes in) and, when its
    results only approximate attention (8-bit QK^T, ...), ``approximate = True``; then it overrides
    ``run``. ``run(q, k, v, mask, scale)`` receives tensors in ``layout`` (``"bhsd"``: (b, h, seq, d);
    ``"bshd"``: (b, seq, h, d)), in a dtype from ``dtypes``, on a device the backend accepted; ``mask``
    is None or as ``attention`` documents it; ``scale`` is a float or None (1/sqrt(d)). It returns the
    output in the same layout and dtype. ``_probe`` (once per process: is it installed?) and
    ``extra_reasons`` (per call kind: why not?) may be overridden too; without ``_probe`` the backend
    counts as available; ``packages`` names the distributions the probe looks for.
    """

    id = ""
    label = ""
    layout = "bhsd"
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = HALF
    approximate = False
    min_sm: int | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    masks: tuple[str, ...] = (NO_MASK, KEY_PADDING, DENSE)
    backward = True
    #: The distributions whose presence and version its probe depends on (``doctor`` lists them).
    packages: tuple[str, ...] = ()

    def probe(self) -> Status:
        try:
            found = self._probe()
        except (ImportError, OSError, RuntimeError, AttributeError) as exc:
            return Status(False, failure_text(exc))
        if found.available and self.devices == ("cuda",) and not torch.cuda.is_available():
            # Asking is_available() counts devices without creating a CUDA context.
            hip = getattr(torch.version, "hip", None)
            build = (f"torch built for ROCm (HIP {hip})" if hip else "a CPU build of torch" if torch.version.cuda is None
                     else f"torch built for CUDA {torch.version.cuda}")
            return Status(False, f"no CUDA device ({build})", found.version)
        return found

    def _probe(self) -> Status:
        return Status(True, version=str(getattr(self, "version", "") or ""))

    def takes_dtype(self, dtype: torch.dtype, device: str) -> bool:
        return dtype in self.dtypes

    def reasons(self, spec: CallSpec, asked: bool = False) -> list[str]:
        """What ``spec`` has against this backend; ``asked`` is True when the user chose it by name."""
        out: list[str] = []
        if spec.device.type not in self.devices:
            out.append(f"device {spec.device.type} not supported ({'/'.join(self.devices)} only)")
            return out
        if not self.takes_dtype(spec.dtype, spec.device.type):
            allowed = "/".join(DTYPE_NAMES[d] for d in FLOATS if self.takes_dtype(d, spec.device.type))
            out.append(f"dtype {spec.dtype_name} not supported ({allowed})")
        if self.min_sm is not None and spec.device.platform == "cuda" and (spec.device.sm or 0) < self.min_sm:
            out.append(f"GPU sm{spec.device.sm} < sm{self.min_sm}")
        if self.max_head_dim is not None and spec.head_dim > self.max_head_dim:
            out.append(f"head_dim {spec.head_dim} > {self.max_head_dim}")
        if spec.head_dim % self.head_dim_multiple:
            out.append(f"head_dim {spec.head_dim} not a multiple of {self.head_dim_multiple}")
        if spec.mask not in self.masks:
            out.append(f"{spec.mask} attention mask not supported")
        if spec.requires_grad and not self.backward:
            out.append("no backward pass (inference only)")
        if spec.exact and self.approximate:
            out.append(EXACT_ASKED)
        # An AMD GPU is a "cuda" device to torch, but NVIDIA's architecture rules do not apply to it.
        out.extend(self.rocm_reasons(spec, asked) if spec.device.platform == "rocm" else self.extra_reasons(spec, asked))
        return out

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        return []

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        """What an AMD GPU (``spec.device.arch``, e.g. gfx942) has against the kernel, in its own terms."""
        return []

    def variant(self, spec: CallSpec) -> str:
        """Which kernel of the package serves ``spec`` (e.g. "FA3"), or "" when there is one."""
        return ""

    def runner(self, spec: CallSpec):
        """The callable that serves ``spec``; chosen once per call signature."""
        return self.run

    def run(self, q, k, v, mask, scale):
        raise NotImplementedError
