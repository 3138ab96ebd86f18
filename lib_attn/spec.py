"""The metadata of one attention call, and the checks that reject bad input before any kernel runs.

Only shapes, dtypes, devices and strides are read here: tensor values are never inspected, so the
checks cost no GPU synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .device import DeviceInfo, device_info

LAYOUTS = ("bhsd", "bshd")
ROLES = ("unet", "dit", "vae", "text")
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Mask kinds, from metadata alone: a key-padding mask has size 1 along heads and queries.
NO_MASK, KEY_PADDING, DENSE = "none", "key-padding", "dense"


@dataclass(frozen=True)
class CallSpec:
    """One call described by its metadata; backends decide on this alone.

    Sizes are those of the call whatever its layout. ``mask`` is one of ``none``, ``key-padding``,
    ``dense``. ``tensors`` holds the real (q, k, v, mask) in bhsd when the spec comes from a call, so
    that PyTorch's own checks can run; a spec written by hand (tests, ``doctor``) has None.
    """

    device: DeviceInfo
    dtype: torch.dtype
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    mask: str = NO_MASK
    mask_dtype: torch.dtype | None = None
    layout: str = "bhsd"
    role: str = "unet"
    requires_grad: bool = False
    tensors: tuple | None = field(default=None, compare=False, repr=False)
    rule: tuple | None = field(default=None, compare=False)
    #: The caller asks for exact attention: an ``approximate`` backend does not take the call.
    exact: bool = False

    def with_dtype(self, dtype: torch.dtype) -> "CallSpec":
        """The same call after a cast to ``dtype`` (PyTorch's checks then see no tensors)."""
        return replace(self, dtype=dtype, tensors=None)

    def describe(self) -> str:
        text = (f"{self.dtype_name} b={self.batch} h={self.heads} q={self.q_len} kv={self.kv_len} "
                f"d={self.head_dim} on {self.device.describe()}")
        return text if self.mask == NO_MASK else f"{text}, {self.mask} mask"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def _shape(t) -> tuple:
    return tuple(t.shape)


def _check_tensor(name: str, t, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D in layout {layout!r}, got shape {_shape(t)}")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16, float32 or float64")


def validate(q, k, v, mask, layout: str, role: str, scale) -> None:
    """Raise ValueError naming the argument when the call is malformed."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, layout)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    seq = 2 if layout == "bhsd" else 1
    head = 1 if layout == "bhsd" else 2
    shapes = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (layout {layout})"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v must have one batch size: {shapes}")
    if not (q.shape[head] == k.shape[head] == v.shape[head]):
        raise ValueError(f"q, k, v must have one number of heads: {shapes}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"q, k, v must have one head_dim: {shapes}")
    if k.shape[seq] != v.shape[seq]:
        raise ValueError(f"k and v must have one sequence length: {shapes}")
    if q.shape[seq] == 0 or k.shape[seq] == 0 or q.shape[0] == 0 or q.shape[head] == 0 or q.shape[3] == 0:
        raise ValueError(f"empty attention call: {shapes}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number or None, got {type(scale).__name__}")
    if mask is not None:
        _check_mask(mask, q, (q.shape[0], q.shape[head], q.shape[seq], k.shape[seq]))


def _check_mask(mask, q, target: tuple) -> None:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"mask must be bool (True takes part) or float (added to the scores), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(target))):
        raise ValueError(f"mask shape {_shape(mask)} does not broadcast to (b, h, q, kv) = {target}")


def mask_kind(mask) -> str:
    if mask is None:
        return NO_MASK
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return KEY_PADDING if shape[1] == 1 and shape[2] == 1 else DENSE


def spec_of(q, k, v, mask, layout: str, role: str, exact: bool = False) -> CallSpec:
    """Describe a validated call; q, k, v are in ``layout``."""
    if layout == "bshd":
        b, n, h, d = q.shape
        kv = k.shape[1]
        bq, bk, bv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    else:
        b, h, n, d = q.shape
        kv = k.shape[2]
        bq, bk, bv = q, k, v
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (mask is not None and mask.requires_grad))
    return CallSpec(
        device=device_info(q.device),
        dtype=q.dtype,
        batch=b, heads=h, q_len=n, kv_len=kv, head_dim=d,
        mask=mask_kind(mask),
        mask_dtype=None if mask is None else mask.dtype,
        layout=layout,
        role=role,
        requires_grad=grad,
        tensors=(bq, bk, bv, mask),
        exact=exact,
    )
