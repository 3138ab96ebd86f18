"""PyTorch's scaled_dot_product_attention: let PyTorch choose (``sdpa``), or one kernel pinned.

A pinned kernel is called as its aten operator. Entering ``torch.nn.attention.sdpa_kernel`` would pin
it too, but costs several microseconds per call, more than the engine's whole budget; the operator
call costs what SDPA's own dispatch costs. When PyTorch's own choice for the call already is the
pinned kernel, the public function runs instead.

``sdpa`` and the pinned kernels call PyTorch's own function (``_compat.TORCH_SDPA``), never the global
``F.scaled_dot_product_attention``, which hosts and extensions replace (SD.Next's SDP overrides, "SageAttention
as SDPA" patches): a call named ``sdpa`` ran PyTorch's SDPA. Such a replacement is found by identity
(``replacement``), named in the ``sdpa`` kernels' description and in ``doctor`` and the status route, and
runs only as the backend of its own, ``sdpa-host``, approximate unless ``LIB_ATTN_SDPA_HOST_EXACT=1`` says
the user trusts it to compute exact attention.

On ROCm the flash and memory-efficient kernels are AOTriton's (see ``_compat.aotriton_missing`` for
which AMD GPUs and torch releases have them) and cuDNN attention does not exist. On MPS PyTorch has
one SDPA implementation (``sdpa``; see ``dispatch.default_chain`` for its memory).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from .. import _compat
from ..spec import DENSE, FLOATS, HALF, KEY_PADDING, NO_MASK, CallSpec
from .base import Backend, Status, additive_bias, as_4d, default_scale, last_dim_contiguous, needs_grad


log = logging.getLogger("lib_attn")
_TORCH_SDPA = _compat.TORCH_SDPA
#: Why neither ``sdpa`` nor ``sdpa-host`` can run on an old torch.
NO_SDPA = Status(False, f"torch {_compat.TORCH_VERSION_TEXT} < 2.1 (no scaled_dot_product_attention with scale)")


def _run_public(q, k, v, mask, scale):
    if scale is None:  # positional arguments parse faster than keywords on this per-call path
        return _TORCH_SDPA(q, k, v, mask)
    return _TORCH_SDPA(q, k, v, mask, scale=scale)


def replacement():
    """What ``F.scaled_dot_product_attention`` holds when a host or extension replaced it; None when it
    is PyTorch's own."""
    found = getattr(F, "scaled_dot_product_attention", None)
    return None if found is None or found is _TORCH_SDPA else found


def callable_name(fn) -> str:
    """Where a function was defined, as ``module.name``. A wrapper made with ``functools.wraps`` copies
    the wrapped function's ``__module__`` and ``__qualname__``, so the defining module's globals and the
    code object are read first: they name the wrapper itself."""
    code = getattr(fn, "__code__", None)
    module = getattr(fn, "__globals__", {}).get("__name__") if code is not None else None
    if code is not None:
        # Python 3.10 has no co_qualname; there a wrapper's own __qualname__ holds only where wraps did not copy it.
        name = getattr(code, "co_qualname", None) or (code.co_name if hasattr(fn, "__wrapped__") else fn.__qualname__)
        return f"{module or '?'}.{name}"
    if isinstance(fn, functools.partial):
        return f"functools.partial({callable_name(fn.func)})"
    kind = type(fn)
    return f"{kind.__module__}.{kind.__qualname__} instance"


_warned: set = set()


def note_replacement() -> str:
    """The replacement in force as a kernel variant (``PyTorch's own, not sdnq.attention.sdpa_override``),
    logged once per replacement; "" when there is none. Read when a call signature is decided, which is rare."""
    found = replacement()
    if found is None:
        return ""
    name = callable_name(found)
    if name not in _warned:
        _warned.add(name)
        log.warning("attention: F.scaled_dot_product_attention is replaced by %s; the engine's sdpa calls run "
                    "PyTorch's own SDPA (choose the backend sdpa-host to run the replacement)", name)
    return f"PyTorch's own, not {name}"


def _same_dtype_mask(mask, dtype):
    if mask is None or mask.dtype == torch.bool or mask.dtype == dtype:
        return mask
    return mask.to(dtype)


#: On ROCm torch.backends.cudnn is MIOpen, which has no fused attention kernel.
ROCM_NO_CUDNN = "cuDNN attention does not exist on ROCm (torch's cudnn there is MIOpen, which has no attention kernel)"


def _rocm_head_dim(spec: CallSpec) -> list[str]:
    limit = _compat.aotriton_max_head_dim()
    return [f"head_dim {spec.head_dim} > {limit} (AOTriton in torch {_compat.TORCH_VERSION_TEXT})"] \
        if spec.head_dim > limit else []


class Sdpa(Backend):
    id = "sdpa"
    label = "PyTorch SDPA (PyTorch picks the kernel)"
    devices = ("cuda", "cpu", "mps", "xpu")
    dtypes = FLOATS

    def _probe(self) -> Status:
        if not _compat.HAS_SDPA:
            return NO_SDPA
        return Status(True, version=f"torch {_compat.TORCH_VERSION_TEXT}")

    def runner(self, spec: CallSpec):
        # The mask dtype is part of the signature: only a float mask of another dtype needs a cast.
        if spec.mask_dtype in (None, torch.bool, spec.dtype):
            return _run_public
        return self.run

    def run(self, q, k, v, mask, scale):
        return _TORCH_SDPA(q, k, v, attn_mask=_same_dtype_mask(mask, q.dtype), scale=scale)

    def variant(self, spec: CallSpec) -> str:
        return note_replacement()


class _PinnedSdpa(Sdpa):
    """One SDPA kernel. ``kernel`` names PyTorch's check (``can_use_<kernel>_attention``)."""

    kernel = ""
    choice = ""
    op = None

    def _probe(self) -> Status:
        base = super()._probe()
        if not base.available:
            return base
        if self.op is None:
            return Status(False, f"torch {_compat.TORCH_VERSION_TEXT} has no {self.kernel} attention operator")
        return base

    def torch_reasons(self, spec: CallSpec) -> list[str]:
        """PyTorch's own verdict on the real tensors, its warnings turned into reasons."""
        check = _compat.CAN_USE.get(self.kernel)
        if spec.tensors is None or spec.device.type != "cuda" or check is None or _compat.SDPA_PARAMS is None:
            return []
        q, k, v, mask = spec.tensors
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                # PyTorch's checks read a mask as 2-D or 4-D only; ours may have any rank up to 4.
                ok = check(_compat.sdpa_params(q, k, v, None if mask is None else as_4d(mask)), True)
            except (RuntimeError, IndexError, TypeError) as exc:
                return [f"PyTorch's {self.kernel} check failed: {exc}"]
        if ok:
            return []
        found = [str(w.message).strip() for w in caught if str(w.message).strip()]
        found = found or [f"PyTorch's {self.kernel} check refuses this call"]
        arch = spec.device.arch
        if (spec.device.platform == "rocm" and not any(_compat.AOTRITON_SWITCH in f for f in found)
                and _compat.AOTRITON_FIRST_TORCH.get(arch, (0, 0)) > _compat.ROCM_FLASH_FROM):
            # PyTorch says "experimental" once per process (TORCH_WARN_ONCE); repeat its hint.
            found.append(f"{arch}: PyTorch may keep AOTriton off on this GPU unless {_compat.AOTRITON_SWITCH}=1 is set")
        return found

    def reasons(self, spec, asked=False):
        # PyTorch's check runs last: it needs the real tensors, and ours already explain the rest.
        return super().reasons(spec, asked) or self.torch_reasons(spec)

    def chosen_by_pytorch(self, spec: CallSpec) -> bool:
        """Whether plain F.scaled_dot_product_attention would run this kernel for the call."""
        if spec.tensors is None or _compat.FUSED_SDP_CHOICE is None or self.choice not in _compat.SDP_BACKEND:
            return False
        q, k, v, mask = spec.tensors
        try:
            return _compat.FUSED_SDP_CHOICE(q, k, v, mask) == _compat.SDP_BACKEND[self.choice]
        except (RuntimeError, TypeError, IndexError):
            return False

    def runner(self, spec: CallSpec):
        public = spec.mask_dtype in (None, torch.bool, spec.dtype) and self.chosen_by_pytorch(spec)
        return _run_public if public else self.run


class SdpaFlash(_PinnedSdpa):
    id = "sdpa-flash"
    label = "PyTorch SDPA flash kernel"
    kernel, choice, op = "flash", "FLASH_ATTENTION", _compat.FLASH_OP
    devices = ("cuda", "cpu")
    min_sm = 80
    max_head_dim = 256
    head_dim_multiple = 8

    def takes_dtype(self, dtype, device):
        # PyTorch's CPU flash kernel takes every float type; its CUDA one fp16/bf16 only.
        return dtype in (FLOATS if device == "cpu" else HALF)

    def reasons(self, spec, asked=False):
        if spec.device.platform == "rocm":
            # AOTriton's head_dim rule (rocm_reasons) replaces the CUDA kernel's.
            cuda_only = (f"head_dim {spec.head_dim} > {self.max_head_dim}",
                         f"head_dim {spec.head_dim} not a multiple of {self.head_dim_multiple}")
            return [r for r in Backend.reasons(self, spec, asked) if r not in cuda_only] or self.torch_reasons(spec)
        if spec.device.type != "cpu":
            return super().reasons(spec, asked)
        # The CPU kernel has no head_dim limit and takes masks from torch 2.3; PyTorch's choice is the check.
        out = [r for r in Backend.reasons(self, spec, asked) if not r.startswith(("head_dim", "GPU"))]
        if not out and spec.mask != NO_MASK and not _compat.CPU_FLASH_TAKES_MASK:
            out.append(f"{spec.mask} attention mask: torch {_compat.TORCH_VERSION_TEXT}'s CPU flash kernel takes no mask")
        if not out and spec.tensors is not None and not self.chosen_by_pytorch(spec):
            out.append("PyTorch would not run its CPU flash kernel for this call")
        return out

    def extra_reasons(self, spec, asked):
        out = []
        if spec.mask != NO_MASK and spec.device.type != "cpu":
            out.append(f"{spec.mask} attention mask not supported")
        if spec.device.type == "cuda" and not _compat.flash_built():
            out.append(f"torch {_compat.TORCH_VERSION_TEXT} was built without its flash kernel")
        return out

    def rocm_reasons(self, spec, asked):
        out = [] if spec.mask == NO_MASK else [f"{spec.mask} attention mask not supported"]
        if not _compat.flash_built():
            out.append(f"torch {_compat.TORCH_VERSION_TEXT} was built without its flash kernel")
        missing = _compat.aotriton_missing(spec.device.arch, "flash")
        if missing:
            return out + [missing]
        return out + _rocm_head_dim(spec)

    def run(self, q, k, v, mask, scale):
        if q.device.type == "cpu":
            return _run_public(q, k, v, mask, scale)
        q, k, v = last_dim_contiguous(q, k, v)
        return self.op(q, k, v, 0.0, False, False, scale=scale)[0]


class SdpaEfficient(_PinnedSdpa):
    id = "sdpa-efficient"
    label = "PyTorch SDPA memory-efficient kernel"
    kernel, choice, op = "efficient", "EFFICIENT_ATTENTION", _compat.EFFICIENT_OP
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    min_sm = 50

    def extra_reasons(self, spec, asked):
        out = []
        # PyTorch's minimum GEMM alignment for this kernel: 8 for 16-bit on sm70+, 4 for fp32 on sm80+.
        sm = spec.device.sm or 0
        multiple = 8 if spec.dtype in HALF and sm >= 70 else 4 if spec.dtype == torch.float32 and sm >= 80 else 1
        if spec.head_dim % multiple:
            out.append(f"head_dim {spec.head_dim} not a multiple of {multiple}")
        if spec.dtype == torch.bfloat16 and (spec.device.sm or 0) < 80:
            out.append(f"bf16 needs sm80, GPU is sm{spec.device.sm}")
        if spec.mask != NO_MASK and not _compat.EFFICIENT_OP_TAKES_BIAS:
            out.append(f"torch {_compat.TORCH_VERSION_TEXT}'s efficient kernel takes no mask")
        return out

    def rocm_reasons(self, spec, asked):
        missing = _compat.aotriton_missing(spec.device.arch, "efficient")
        if missing:
            return [missing]
        out = _rocm_head_dim(spec)
        # PyTorch's ROCm rule: head_dim a multiple of 8 for 16-bit inputs, of 4 for fp32.
        multiple = 8 if spec.dtype in HALF else 4
        if spec.head_dim % multiple:
            out.append(f"head_dim {spec.head_dim} not a multiple of {multiple}")
        return out

    def run(self, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        bias = None if mask is None else additive_bias(mask, q.dtype, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), 16)
        # Backward needs the log-sum-exp of the forward.
        return self.op(q, k, v, bias, needs_grad(q, k, v, bias), 0.0, False, scale=scale)[0]


class SdpaCudnn(_PinnedSdpa):
    id = "sdpa-cudnn"
    label = "PyTorch SDPA cuDNN kernel"
    kernel, choice, op = "cudnn", "CUDNN_ATTENTION", _compat.CUDNN_OP
    devices = ("cuda",)
    dtypes = HALF
    min_sm = 80
    head_dim_multiple = 8

    @property
    def masks(self):
        return (NO_MASK, KEY_PADDING, DENSE) if _compat.CUDNN_OP_TAKES_BIAS else (NO_MASK,)

    def _probe(self) -> Status:
        if getattr(torch.version, "hip", None):  # whatever the torch release: ROCm has no cuDNN at all
            return Status(False, ROCM_NO_CUDNN)
        status = super()._probe()
        if status.available and not torch.backends.cudnn.is_available():
            return Status(False, "cuDNN is not available in this torch build")
        return status

    def extra_reasons(self, spec, asked):
        out = []
        switched_off = _compat.cudnn_sdpa_switched_off()
        if switched_off:
            out.append(switched_off)
        # 256 only on sm90 and sm10x (with a recent cuDNN, which PyTorch's own check verifies).
        major, minor = spec.device.capability or (0, 0)
        limit = 256 if (major, minor) == (9, 0) or major == 10 else 128
        if spec.head_dim > limit:
            out.append(f"head_dim {spec.head_dim} > {limit}")
        if spec.kv_len == 1:
            out.append("kv_len 1 not supported")
        return out

    def rocm_reasons(self, spec, asked):
        return [ROCM_NO_CUDNN]

    def run(self, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        if _compat.CUDNN_OP_TAKES_BIAS:
            # cuDNN mishandles -inf in a bias; PyTorch masks with the most negative fp16 value for it.
            bias = None if mask is None else additive_bias(
                mask, q.dtype, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), 16, neg=-65504.0)
            return self.op(q, k, v, bias, needs_grad(q, k, v, bias), 0.0, False, False, scale=scale)[0]
        return self.op(q, k, v, 0.0, False, False, scale=scale)[0]


class SdpaMath(_PinnedSdpa):
    id = "sdpa-math"
    label = "PyTorch SDPA math kernel (full score matrix)"
    kernel, choice, op = "math", "MATH", _compat.MATH_OP
    devices = ("cuda", "cpu", "mps", "xpu")
    dtypes = FLOATS

    def run(self, q, k, v, mask, scale):
        # Below F.scaled_dot_product_attention a mask is additive: PyTorch converts bool ones above it.
        bias = None if mask is None else additive_bias(mask, q.dtype, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        return self.op(q, k, v, bias, scale=default_scale(scale, q.shape[-1]))[0]


#: ``LIB_ATTN_SDPA_HOST_EXACT=1``: the user vouches that the host's replacement computes exact attention.
SDPA_HOST_EXACT = "LIB_ATTN_SDPA_HOST_EXACT"


class SdpaHost(Backend):
    """Whatever a host or extension put in place of ``F.scaled_dot_product_attention``, run as that
    replacement under its own id, only when chosen by name. What it computes is not known: it is held
    to the approximate bound (and kept off calls asking for exact attention) unless the user sets
    ``LIB_ATTN_SDPA_HOST_EXACT=1``, and it is not trusted with gradients."""

    id = "sdpa-host"
    label = "the host's replacement of F.scaled_dot_product_attention"
    devices = ("cuda", "cpu", "mps", "xpu")
    dtypes = FLOATS
    backward = False

    @property
    def approximate(self) -> bool:
        return os.environ.get(SDPA_HOST_EXACT) != "1"

    #: A host replaces the function after the engine loads (or puts its own back): asked each time.
    probe_each_time = True

    def _probe(self) -> Status:
        if not _compat.HAS_SDPA:
            return NO_SDPA
        found = replacement()
        if found is None:
            return Status(False, "nothing replaced F.scaled_dot_product_attention here (it is PyTorch's own)")
        return Status(True, version=callable_name(found))

    def run(self, q, k, v, mask, scale):
        fn = replacement()
        if fn is None:
            # Taken off after this kernel was chosen: running PyTorch's own under this id would say
            # the replacement ran. The call falls back, with this reason, to the next backend.
            raise RuntimeError("F.scaled_dot_product_attention is PyTorch's own again (its replacement was "
                               "taken off)")
        # A replacement that routes its calls to this engine (a script's "every SDPA through
        # lib_attn") would come back here call after call until Python's recursion limit, each level
        # counted as sdpa-host. Both the call back and this call fail at once, so the call falls back.
        here = _inside_host
        if getattr(here, "depth", 0):
            here.called_back = True
            raise RuntimeError(REPLACEMENT_CALLS_BACK)
        here.depth, here.called_back = 1, False
        try:
            out = fn(q, k, v, attn_mask=_same_dtype_mask(mask, q.dtype), scale=scale)
        finally:
            here.depth = 0
        if here.called_back:
            raise RuntimeError(REPLACEMENT_CALLS_BACK)
        return out


#: Per thread: inside the host's replacement (``depth``), and whether it called the engine back.
_inside_host = threading.local()
REPLACEMENT_CALLS_BACK = ("F.scaled_dot_product_attention's replacement calls this engine back (it routes its "
                          "calls here), so it cannot run as a kernel of its own")
