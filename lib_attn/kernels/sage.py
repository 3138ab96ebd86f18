"""SageAttention 1.x/2.x: quantised QK^T on NVIDIA GPUs, fp16/bf16, head_dim <= 128, inference only.

``sage`` runs ``sageattn``, which picks a kernel per GPU; the others pin one kernel of SageAttention 2,
as Forge Neo's ``--sage2-function`` does: ``sage-triton`` (INT8 QK, fp16 PV, Triton; SageAttention 1's
only kernel), ``sage-cuda`` (INT8 QK, fp16 PV, CUDA), ``sage-fp8`` (INT8 QK, fp8 PV, fp32 accumulation;
the sm90 kernel on Hopper) and ``sage-fp8pp`` (SageAttention2++: fp8 PV with fp16 accumulation).

What each release computes correctly comes from ``sage_facts``: a call the installed kernel would
miscompute (the Triton kernel's last key block before 2.2.0) is refused with the reason, never run.
``sageattn`` accepts a mask keyword and drops it without a word, so a masked call only reaches the
Triton kernel of a release that applies masks. The caller's tensors are never written and the
caller's current CUDA device stays current (2.x calls ``torch.cuda.set_device`` on every call). There
is no ROCm build: the kernels are CUDA, and Triton for NVIDIA only.
"""
from __future__ import annotations

from functools import partial

import torch

from ..spec import DENSE, KEY_PADDING, NO_MASK, CallSpec, spec_of
from . import sage_facts
from .base import Backend, Status, as_4d, last_dim_contiguous
from .sage_facts import SAGE1_HEAD_DIMS, SageFacts

#: Kernel kinds as the readout names them.
KIND_NAMES = {"triton": "Triton", "cuda": "fp16 CUDA", "fp8": "fp8 CUDA", "fp8-sm90": "fp8 CUDA sm90"}
#: GPUs each 2.x kernel kind runs on, from the package's dispatch and its compiled targets.
KIND_SMS = {"fp8": (89, 120, 121), "fp8-sm90": (90,)}
#: 2.x's Triton and fp16 CUDA kernels start at Ampere; 1.x's Triton kernel at Volta.
MIN_SM = {1: 70, 2: 80}
#: The compiled kernels' names in a reason.
COMPILED_NAMES = {"cuda": "sm80 (fp16 CUDA)", "fp8": "sm89 (fp8 CUDA)", "fp8-sm90": "sm90 (fp8 CUDA)"}
#: Where the package's per-warp quantisation replaces per-thread: consumer Blackwell, as sageattn does.
PER_WARP_SMS = (120, 121)


def kind_reasons(facts: SageFacts, kind: str, spec: CallSpec) -> list[str]:
    """What ``spec`` has against the ``kind`` kernel of this release (its GPU, head sizes, faults)."""
    sm = spec.device.sm or 0
    out = []
    if facts.major <= 1:
        if sm < MIN_SM[1]:
            out.append(f"GPU sm{sm} < sm{MIN_SM[1]}")
        if spec.dtype == torch.bfloat16 and sm < 80:
            out.append(f"bf16 needs sm80, GPU is sm{sm}")
        if spec.head_dim not in SAGE1_HEAD_DIMS:
            out.append(f"head_dim {spec.head_dim} not in {'/'.join(map(str, SAGE1_HEAD_DIMS))} ({facts.name})")
    elif kind in KIND_SMS and sm not in KIND_SMS[kind]:
        out.append(f"GPU sm{sm}: {facts.name}'s {KIND_NAMES[kind]} kernel runs on "
                   f"sm{', sm'.join(map(str, KIND_SMS[kind]))} only")
    elif sm < MIN_SM[2]:
        out.append(f"GPU sm{sm} < sm{MIN_SM[2]} ({facts.name})")
    if kind in COMPILED_NAMES and kind not in facts.compiled:
        out.append(f"{facts.name} is installed without its {COMPILED_NAMES[kind]} kernels")
    fault = facts.padding_fault(kind, spec.kv_len)
    if fault:
        out.append(fault)
    return out


def _on_device(fn, q, *args, **kwargs):
    """Call a 2.x kernel, which makes q's device the current one: keep the caller's current device."""
    if q.device.type != "cuda" or q.device.index == torch.cuda.current_device():
        return fn(q, *args, **kwargs)
    with torch.cuda.device(q.device):
        return fn(q, *args, **kwargs)


def _run_sage1(sageattn, q, k, v, mask, scale):
    # 1.x subtracts the key mean from the k it is given, in place: it gets a centred copy instead, and
    # its own smoothing is off (the same arithmetic, on a tensor of its own).
    q, k, v = last_dim_contiguous(q, k, v)
    k = k - k.mean(dim=2, keepdim=True)
    return sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale, smooth_k=False)


class Sage(Backend):
    """``sageattn``: the package's own kernel for the GPU."""

    id = "sage"
    label = "SageAttention (8-bit QK; the package's kernel for the GPU)"
    packages = ("sageattention", "triton", "triton-windows", "kernels")
    approximate = True
    max_head_dim = 128
    masks = (NO_MASK,)
    backward = False

    def __init__(self):
        self.facts: SageFacts | None = None

    def _probe(self) -> Status:
        self.facts = None
        self.facts = sage_facts.load()
        return self.facts_status(self.facts)

    def facts_status(self, facts: SageFacts) -> Status:
        return Status(True, version=facts.version)

    def kind(self, spec: CallSpec) -> str | None:
        """The kernel kind that serves ``spec``, or None when the release has none for its GPU."""
        if self.facts.major <= 1:
            return "triton"
        return self.facts.dispatch.get(spec.device.sm or 0)

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        kind = self.kind(spec)
        if kind is None:
            sms = ", sm".join(map(str, sorted(self.facts.dispatch)))
            return [f"GPU sm{spec.device.sm} has no {self.facts.name} kernel (sageattn runs on sm{sms})"]
        return kind_reasons(self.facts, kind, spec)

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        return [f"{spec.device.arch or 'AMD GPU'}: SageAttention has no ROCm build (CUDA kernels only)"]

    def variant(self, spec: CallSpec) -> str:
        if self.facts is None or self.facts.major <= 1:
            return ""
        return KIND_NAMES.get(self.kind(spec), "")

    def sage2_function(self):
        """The 2.x function ``run`` calls."""
        return self.facts.sageattn

    def run(self, q, k, v, mask, scale):
        if self.facts.major <= 1:
            return _run_sage1(self.facts.sageattn, q, k, v, mask, scale)
        q, k, v = last_dim_contiguous(q, k, v)
        extra = {}
        if mask is not None:
            # Only a kernel that applies masks gets one: as bool, or in q's dtype, broadcast to (b, h, q, kv).
            m = as_4d(mask)
            extra["attn_mask"] = m if m.dtype == torch.bool else m.to(q.dtype)
        return _on_device(self.sage2_function(), q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale,
                          **extra)


class SageKernel(Sage):
    """One SageAttention 2 kernel, pinned: ``kinds`` are the kinds it runs (the first its GPU takes),
    ``pv_accum`` the accumulation it asks for."""

    kinds: tuple[str, ...] = ()
    pv_accum: str | None = None

    def facts_status(self, facts: SageFacts) -> Status:
        if facts.major <= 1:
            return Status(False, f"{facts.name} has only its Triton kernel (use sage or sage-triton)", facts.version)
        missing = [sage_facts.FUNCTIONS[k] for k in self.kinds if k not in facts.functions]
        if len(missing) == len(self.kinds):
            return Status(False, f"{facts.name} has no {' or '.join(missing)}", facts.version)
        return Status(True, version=facts.version)

    def kind(self, spec: CallSpec) -> str | None:
        """The first of ``kinds`` the package has and the GPU runs, or None."""
        sm = spec.device.sm or 0
        return next((k for k in self.kinds if k in self.facts.functions and sm in KIND_SMS.get(k, (sm,))), None)

    def variant(self, spec: CallSpec) -> str:
        return ""

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        kind = self.kind(spec)
        if kind is None:
            sms = sorted(sm for k in self.kinds if k in self.facts.functions for sm in KIND_SMS.get(k, ()))
            return [f"GPU sm{spec.device.sm}: {self.facts.name}'s {KIND_NAMES[self.kinds[-1]]} kernels run on "
                    f"sm{', sm'.join(map(str, sms))} only"]
        return kind_reasons(self.facts, kind, spec)

    def kwargs(self, spec: CallSpec) -> dict:
        out = {"pv_accum_dtype": self.pv_accum} if self.pv_accum else {}
        if spec.device.sm in PER_WARP_SMS:
            out["qk_quant_gran"] = "per_warp"
        return out

    def runner(self, spec: CallSpec):
        fn = self.facts.functions[self.kind(spec)]
        return partial(self._run_kernel, fn, self.kwargs(spec))

    def run(self, q, k, v, mask, scale):
        return self.runner(spec_of(q, k, v, mask, "bhsd", "unet"))(q, k, v, mask, scale)

    def _run_kernel(self, fn, kwargs, q, k, v, mask, scale):
        q, k, v = last_dim_contiguous(q, k, v)
        return _on_device(fn, q, k, v, tensor_layout="HND", is_causal=False, sm_scale=scale, **kwargs)


class SageTriton(SageKernel):
    """The Triton kernel: SageAttention 1's only one, 2.x's ``sageattn_qk_int8_pv_fp16_triton``, which
    applies masks from the release that fixed its key padding (2.2.0)."""

    id = "sage-triton"
    label = "SageAttention INT8 QK, fp16 PV (Triton)"
    kinds = ("triton",)
    masks = (NO_MASK, KEY_PADDING, DENSE)

    def facts_status(self, facts: SageFacts) -> Status:
        return Status(True, version=facts.version) if facts.major <= 1 else super().facts_status(facts)

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = super().extra_reasons(spec, asked)
        if spec.mask != NO_MASK and not self.facts.triton_masks:
            out.append(f"{spec.mask} attention mask: {self.facts.name}'s Triton kernel takes none (from 2.2.0 it does)")
        if spec.device.sm in PER_WARP_SMS and self.facts.major > 1 and not asked:
            out.append(f"GPU sm{spec.device.sm}: sageattn does not use its Triton kernel there (named, it runs)")
        return out

    def sage2_function(self):
        return self.facts.functions["triton"]

    def runner(self, spec: CallSpec):
        return self.run

    run = Sage.run


class SageCuda(SageKernel):
    id = "sage-cuda"
    label = "SageAttention 2 INT8 QK, fp16 PV (CUDA)"
    kinds = ("cuda",)
    pv_accum = "fp32"


class SageFp8(SageKernel):
    id = "sage-fp8"
    label = "SageAttention 2 INT8 QK, fp8 PV, fp32 accumulation (CUDA)"
    kinds = ("fp8-sm90", "fp8")
    pv_accum = "fp32+fp32"


class SageFp8pp(SageKernel):
    """SageAttention2++: the fp8 PV kernel with fp16 accumulation inside fp32 (sageattn's choice on sm89
    and sm120 from 2.2.0); the sm90 kernel has no such mode."""

    id = "sage-fp8pp"
    label = "SageAttention2++ INT8 QK, fp8 PV, fp16 accumulation (CUDA)"
    kinds = ("fp8",)
    pv_accum = "fp32+fp16"

    def facts_status(self, facts: SageFacts) -> Status:
        found = super().facts_status(facts)
        if found.available and not facts.fp8_fp16_accum:
            return Status(False, f"{facts.name}'s fp8 kernel has no fp32+fp16 accumulation (from 2.2.0)", facts.version)
        return found
