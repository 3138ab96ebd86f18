"""What an installed SageAttention computes correctly, read once from the package itself.

SageAttention's releases differ in ways its version string does not always tell, so the facts come
from the installed package's own Python where it can be read, and from the release history where not
(thu-ml/SageAttention, tags v2.0.1 and v2.2.0 and the commits between; PyPI's 1.0.6):

* **The Triton kernel's last key block.** Up to August 2025 the Triton kernel (SageAttention 1.x's only
  kernel, 2.x's ``sageattn_qk_int8_pv_fp16_triton``) loads the keys past ``kv_len`` in the last 64-key
  block as zeros and never masks them: each row's softmax then gives them weight, and every call whose
  kv_len is not a multiple of 64 is wrong (SD's 77-token cross-attention by a relative error near 0.28).
  The fix adds ``tl.where(k_mask, ...)`` to the scores; it shipped in 2.2.0, but the version string
  2.2.0 was set in June 2025, so a 2.2.0 built before August lacks it: the kernel file is read.
* **Which kernel ``sageattn`` runs per GPU.** Its dispatch is a chain of ``arch == "smNN"`` tests in
  ``sageattn``; the table is read from that source (2.0.x: sm80/86/89/90; 2.1.1: + sm120; builds after
  2.2.0: + sm121), with the release's table as the fallback.
* **Which compiled kernels loaded.** 2.1+ sets ``SM80_ENABLED``/``SM89_ENABLED``/``SM90_ENABLED``; 2.0.x
  imports one compiled module and has all of them or fails to import.
* **Where it comes from.** The ``sageattention`` package, else the kernel hub's cached build of it
  (``kernels-community/sage-attention``, which exports ``sageattn`` and SageAttention 3's function but
  not the pinned 2.x kernels), shown as ``hub <source>``.
* **The caller's tensors.** 1.x subtracts the key mean from the caller's ``k`` in place (``k -= km``);
  2.x does not. The backends never hand 1.x the caller's ``k``.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass, field

from . import hub
from .base import release
from .flash import _version_of

#: Kernel kinds -> the 2.x function that runs them.
FUNCTIONS = {
    "triton": "sageattn_qk_int8_pv_fp16_triton",
    "cuda": "sageattn_qk_int8_pv_fp16_cuda",
    "fp8": "sageattn_qk_int8_pv_fp8_cuda",
    "fp8-sm90": "sageattn_qk_int8_pv_fp8_cuda_sm90",
}
#: The compiled module each 2.x CUDA kernel kind needs, as 2.1+ names its flag.
COMPILED_FLAG = {"cuda": "SM80_ENABLED", "fp8": "SM89_ENABLED", "fp8-sm90": "SM90_ENABLED"}
#: ``sageattn``'s dispatch per release, where its source cannot be read.
DISPATCH_2_0 = {80: "cuda", 86: "triton", 89: "fp8", 90: "cuda"}
DISPATCH_2_1 = {80: "cuda", 86: "triton", 89: "fp8", 90: "fp8-sm90", 120: "fp8"}
#: Names only SageAttention 2 exports (its pinned kernels, or the CUDA quantisation a hub build exports).
SAGE2_ONLY = tuple(FUNCTIONS.values()) + ("per_warp_int8", "per_channel_fp8")
#: SageAttention 1.x asserts one of these head sizes; 2.x pads up to 64 or 128 and takes at most 128.
SAGE1_HEAD_DIMS = (64, 96, 128)
#: The key block of the Triton kernel: with the padding fault, kv_len must be a multiple of it.
KEY_BLOCK = 64
FIXED_IN = "2.2.0"


@dataclass(frozen=True)
class SageFacts:
    """One installed ``sageattention``: ``functions`` maps kernel kinds to its callables (2.x), or
    ``{"triton": sageattn}`` on 1.x; ``dispatch`` maps an NVIDIA sm to the kind ``sageattn`` runs there;
    ``compiled`` holds the CUDA kinds whose compiled module loaded; ``triton_pads_right``: its Triton
    kernel masks the keys past kv_len; ``triton_masks``: that kernel takes ``attn_mask``;
    ``fp8_fp16_accum``: its fp8 kernel offers the fp32+fp16 accumulation of SageAttention2++."""

    version: str
    major: int
    sageattn: object = field(repr=False)
    functions: dict = field(default_factory=dict, repr=False)
    dispatch: dict = field(default_factory=dict)
    compiled: frozenset = frozenset()
    triton_pads_right: bool = False
    triton_masks: bool = False
    fp8_fp16_accum: bool = False

    @property
    def name(self) -> str:
        return f"SageAttention {self.version}" if self.version else f"SageAttention {self.major}"

    def padding_fault(self, kind: str, kv_len: int) -> str | None:
        """Why a ``kind`` kernel of this release miscomputes a call with ``kv_len`` keys, or None."""
        if kind != "triton" or self.triton_pads_right or kv_len % KEY_BLOCK == 0:
            return None
        which = self.name if self.major <= 1 else f"{self.name}'s Triton kernel"
        if release(self.version) == (0, 0, 0):  # a build with no release number: the fix was not found in it
            return (f"kv_len {kv_len} not a multiple of {KEY_BLOCK}: {which} is not shown to mask the keys past "
                    f"kv_len (the fix of {FIXED_IN})")
        return f"kv_len {kv_len} not a multiple of {KEY_BLOCK}: {which} miscomputes it (fixed in {FIXED_IN})"


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _file_text(module, relative: str) -> str:
    path = os.path.join(os.path.dirname(getattr(module, "__file__", "") or ""), relative)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def read_dispatch(source: str) -> dict:
    """``sageattn``'s ``arch == "smNN"`` chain -> {NN: kernel kind}, from its source; {} when unreadable."""
    by_name = {name: kind for kind, name in FUNCTIONS.items()}
    table, pending = {}, []
    for line in source.splitlines():
        pending += [int(sm) for sm in re.findall(r'arch\s*==\s*["\']sm(\d+)["\']', line)]
        called = re.search(r"return\s+(\w+)\(", line)
        if called and pending:
            kind = by_name.get(called.group(1))
            if kind is not None:
                table.update({sm: kind for sm in pending})
            pending = []
    return table


#: The fix's mark in the Triton kernel: the scores of keys past kv_len masked out.
_MASKED_TAIL = re.compile(r"tl\.where\(\s*k_mask")


def read(module, version: str | None = None) -> SageFacts:
    """The facts of an imported ``sageattention`` (or a build of it); ``version`` when its metadata has none."""
    version = version or _version_of(module, "sageattention")
    # Without metadata (a source checkout, a hub build), 2.x is told by what it exports beyond 1.x's API.
    major = release(version)[0] or (2 if any(hasattr(module, n) for n in SAGE2_ONLY) else 1)
    sageattn = module.sageattn
    if major <= 1:
        # 1.x: sageattn is the Triton kernel, with the padding fault in every release.
        return SageFacts(version, major, sageattn, {"triton": sageattn})
    core = _core(module)
    functions = {kind: getattr(module, name) for kind, name in FUNCTIONS.items() if callable(getattr(module, name, None))}
    dispatch = read_dispatch(_source(sageattn)) or (DISPATCH_2_0 if release(version) < (2, 1, 0) else DISPATCH_2_1)
    # 2.0.x has no flags: it imported, so its compiled kernels loaded.
    compiled = frozenset(kind for kind, flag in COMPILED_FLAG.items() if getattr(core, flag, True))
    kernel = _file_text(module, os.path.join("triton", "attn_qk_int8_per_block.py"))
    # Without the kernel's source, a release number decides; a build without one (the hub's) is not trusted.
    pads_right = bool(_MASKED_TAIL.search(kernel)) if kernel else release(version) >= release(FIXED_IN)
    triton = functions.get("triton")
    masks = triton is not None and "attn_mask" in _parameters(triton) and pads_right
    fp8 = functions.get("fp8")
    fp8_text = _source(fp8) if fp8 is not None else ""
    fp16_accum = fp8 is not None and (("fp32+fp16" in fp8_text) if fp8_text else release(version) >= (2, 2, 0))
    return SageFacts(version, major, sageattn, functions, dispatch, compiled, pads_right, masks, fp16_accum)


def _core(module):
    """The module holding the compiled-kernel flags: the package's ``core`` (2.x), else the module itself."""
    try:
        return importlib.import_module(module.__name__ + ".core")
    except ImportError:
        return module


def _parameters(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def load() -> SageFacts:
    """Import ``sageattention`` and read its facts; without it, the kernel hub's cached build (``hub``).
    An ImportError naming both sources propagates to the probe."""
    try:
        return read(importlib.import_module("sageattention"))
    except ImportError as exc:
        module, why = hub.load("sage")
        if module is None:
            raise type(exc)(f"{exc}; hub: {why}") from exc
        return read(module, version=f"hub {module.hub_source}")
