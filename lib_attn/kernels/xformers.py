"""xformers' ``memory_efficient_attention``; its own operator dispatch explains a refusal.

ROCm builds of xformers (facebookresearch/xformers PR #978, in releases from 0.0.25; wheels on PyTorch's
rocm indexes) run Composable Kernel attention (``ckF``/``ckB``) built for CDNA GPUs only, MI200/MI300
(gfx90a, gfx942); RDNA GPUs have no kernel (ROCm/xformers issue #83).
"""
from __future__ import annotations

import importlib

import torch

from ..spec import CallSpec
from .base import Backend, Status, additive_bias, failure_text
from .flash import _version_of


ROCM_ARCHS = ("gfx90a", "gfx942")


class Xformers(Backend):
    id = "xformers"
    label = "xformers memory_efficient_attention"
    packages = ("xformers",)
    layout = "bshd"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    min_sm = 50

    def __init__(self):
        self.ops = None

    def _probe(self) -> Status:
        self.ops = None
        module = importlib.import_module("xformers")
        ops = importlib.import_module("xformers.ops")
        ops.memory_efficient_attention  # noqa: B018 - the entry point must resolve
        if getattr(module, "_has_cpp_library", True) is False:
            return Status(False, "xformers is installed but its C++/CUDA extension did not load (built for another torch?)")
        self.ops = ops
        return Status(True, version=_version_of(module, "xformers"))

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = []
        if spec.dtype == torch.bfloat16 and (spec.device.sm or 0) < 80:
            out.append(f"bf16 needs sm80, GPU is sm{spec.device.sm}")
        if not out and spec.tensors is not None and self.ops is not None:
            out.extend(self._own_reasons(spec))
        return out

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        if spec.device.arch not in ROCM_ARCHS:
            return [f"{spec.device.arch or 'this AMD GPU'}: xformers' ROCm build has attention kernels for "
                    f"MI200/MI300 (gfx90a, gfx942) only"]
        return self._own_reasons(spec) if spec.tensors is not None and self.ops is not None else []

    def _own_reasons(self, spec: CallSpec) -> list[str]:
        """Ask xformers' dispatcher whether any of its operators takes the call."""
        try:
            fmha = importlib.import_module("xformers.ops.fmha")
        except ImportError:
            return []
        dispatch_fw = getattr(fmha, "_dispatch_fw", None) or getattr(getattr(fmha, "dispatch", None), "_dispatch_fw", None)
        if dispatch_fw is None:
            return []  # a release without this private API: the kernel call itself decides
        q, k, v = (t.transpose(1, 2) for t in spec.tensors[:3])
        mask = spec.tensors[3]
        bias = None if mask is None else additive_bias(mask, q.dtype, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), 16)
        try:
            dispatch_fw(fmha.Inputs(query=q, key=k, value=v, attn_bias=bias), spec.requires_grad)
        except NotImplementedError as exc:
            return _operator_reasons(str(exc)) or [failure_text(exc)]
        except (AttributeError, TypeError):
            return []
        return []

    def run(self, q, k, v, mask, scale):
        bias = None if mask is None else additive_bias(mask, q.dtype, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), 16)
        return self.ops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)


def _operator_reasons(message: str) -> list[str]:
    """xformers lists each operator as "`name` is not supported because:" followed by indented
    reasons; keep them as "name: reason" strings."""
    out, op = [], ""
    for line in message.splitlines():
        text = line.strip()
        if text.startswith("`"):
            op = text.split("`")[1]
        elif op and text and line[:1].isspace():
            out.append(f"{op}: {text}")
    return out
