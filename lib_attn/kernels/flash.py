"""The flash-attn package: FlashAttention-2, or FlashAttention-3 (``flash_attn_interface``) on sm90.

FA3 is built from the same repository's ``hopper/`` folder and has shipped under three distribution
names: ``flashattn-hopper`` (2.6.x), ``flash_attn`` (2.7.x, the same name as FA2's) and ``flash_attn_3``
(2.8.x); its version is read from whichever distribution holds the ``flash_attn_interface`` module.
FA3 of 2.6.x has kernels for head sizes 64, 128 and 256 only (other head sizes go to FA2 per call)
and checks that q, k and v are contiguous, not only along head_dim as later releases do.
``flash_attn_func`` returns ``(out, lse)`` from 2.6.2 to 2.8.1 and ``out`` from 2.8.2.
Either one may also come from the Hugging Face kernel hub (``hub.py``) when no package is installed.

flash-attn enforces its limits inside the kernel, so they are restated here from its documentation:
CUDA, fp16/bf16, head_dim <= 256, no dense mask. Official builds start at sm80; community builds run
on Volta/Turing (fp16), so on an older GPU a user who asked for flash-attn by name gets one trial call.

On ROCm (flash-attn 2.8 README, "AMD ROCm Support"; flash_attn/flash_attn_interface.py) the package
is one of two builds: the Composable Kernel build (the default) for MI200/MI300/MI350 (gfx90a, gfx942,
gfx950; RDNA3/4 only in source builds after 2.8.4), fp16/bf16, head_dim <= 256; or the Triton build,
chosen by ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` at build and import time, which covers CDNA and
RDNA GPUs. Any other AMD GPU gets the same trial call when the user asks for flash-attn by name.
"""
from __future__ import annotations

import importlib

import torch

from ..spec import KEY_PADDING, NO_MASK, CallSpec
from . import hub
from .base import Backend, Status, default_scale, failure_text, release


def _version_of(module, dist: str) -> str:
    version = getattr(module, "__version__", "")
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version(dist)
    except ImportError:  # PackageNotFoundError: a source checkout has no metadata
        return ""


#: Distribution names FA3 has been published under, newest first (flash_attn 2.7.x shares FA2's name).
FA3_DISTS = ("flash_attn_3", "flashattn-hopper", "flash_attn")
#: The head sizes FA3 2.6.x has kernels for.
FA3_26_HEAD_DIMS = (64, 128, 256)


def fa3_version(module) -> str:
    """The version of the installed FA3: that of the distribution holding ``flash_attn_interface``."""
    found = getattr(module, "__version__", "") or ""
    if found:
        return str(found)
    from importlib import metadata

    try:
        owners = metadata.packages_distributions().get("flash_attn_interface", [])
    except (AttributeError, OSError):  # packages_distributions is Python 3.10+; broken metadata
        owners = []
    for dist in list(owners) + [d for d in FA3_DISTS if d not in owners]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def _hub_fa3_interface(module):
    """The hub's FA3 build exposes ``flash_attn_func`` itself or in ``flash_attn_interface``."""
    return module if hasattr(module, "flash_attn_func") else getattr(module, "flash_attn_interface", None)


#: AMD architectures each ROCm build of flash-attn documents, and how a reason says so.
CK_ARCHS = ("gfx90a", "gfx942", "gfx950")
TRITON_ARCH_PREFIXES = ("gfx90a", "gfx942", "gfx950", "gfx11", "gfx12")
ROCM_COVERAGE = {
    "CK": ("the CK build covers MI200/MI300/MI350 (gfx90a, gfx942, gfx950); the Triton build "
           "(FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE) also covers RDNA3/4"),
    "Triton": "its Triton build covers CDNA (gfx90a, gfx942, gfx950) and RDNA3/4 (gfx11xx, gfx12xx)",
}


class FlashAttn(Backend):
    id = "flash-attn"
    label = "flash-attn (FlashAttention-2/3)"
    packages = ("flash-attn", "flash_attn_3", "flashattn-hopper", "kernels")
    layout = "bshd"
    max_head_dim = 256
    masks = (NO_MASK, KEY_PADDING)

    def __init__(self):
        self.fa2 = None  # module flash_attn, when it loads
        self.fa3 = None  # module flash_attn_interface (FA3, Hopper), when it loads
        self.fa2_error = ""
        self.fa3_error = ""
        self.trials: dict = {}
        self.rocm_build = ""  # "CK" or "Triton" on a ROCm build of torch
        self.fa2_version = ""
        self.fa3_version = ""  # e.g. "2.6.3"; "hub ..." for a hub build

    def _probe(self) -> Status:
        self.fa2 = self.fa3 = None
        self.fa2_version = self.fa3_version = ""
        try:
            module = importlib.import_module("flash_attn")
            module.flash_attn_func, module.flash_attn_varlen_func  # noqa: B018 - the kernels must resolve
            self.fa2, self.fa2_version = module, _version_of(module, "flash-attn")
        except (ImportError, OSError, RuntimeError, AttributeError) as exc:
            self.fa2_error = failure_text(exc)
            self.fa2, self.fa2_version = self._from_hub("flash-attn2", self.fa2_error)
        try:
            self.fa3 = importlib.import_module("flash_attn_interface")
            self.fa3_version = fa3_version(self.fa3)
        except (ImportError, OSError, RuntimeError) as exc:
            self.fa3_error = failure_text(exc)
            module, self.fa3_version = self._from_hub("flash-attn3", self.fa3_error)
            self.fa3 = None if module is None else _hub_fa3_interface(module)
        if self.fa2 is None and self.fa3 is None:
            return Status(False, self.fa2_error)
        self.rocm_build = ""
        if getattr(torch.version, "hip", None) and self.fa2 is not None and not self.fa2_version.startswith("hub"):
            interface = importlib.import_module("flash_attn.flash_attn_interface")
            self.rocm_build = "Triton" if getattr(interface, "USE_TRITON_ROCM", False) else "CK"
        fa3 = f"FA3 {self.fa3_version}".strip() if self.fa3 is not None else ""
        if self.fa2 is None:
            return Status(True, version=fa3)
        return Status(True, version=f"{self.fa2_version} + {fa3}" if fa3 else self.fa2_version)

    def _from_hub(self, kind: str, import_error: str):
        """(module, "hub <source>") from the kernel hub's local cache, or (None, "") adding why to the error."""
        module, why = hub.load(kind)
        if module is None:
            if kind == "flash-attn2":
                self.fa2_error = f"{import_error}; hub: {why}"
            else:
                self.fa3_error = f"{import_error}; hub: {why}"
            return None, ""
        return module, f"hub {module.hub_source}"

    def fa3_is_26(self) -> bool:
        return not self.fa3_version.startswith("hub") and release(self.fa3_version)[:2] == (2, 6)

    def fa3_head_dims(self) -> tuple | None:
        """The head sizes the installed FA3 has kernels for, or None for any multiple of 8."""
        return FA3_26_HEAD_DIMS if self.fa3_is_26() else None

    def _fa3_takes(self, head_dim: int) -> bool:
        fixed = self.fa3_head_dims()
        return head_dim % 8 == 0 and (fixed is None or head_dim in fixed)

    def variant(self, spec: CallSpec) -> str:
        if spec.device.platform == "rocm":
            return self.rocm_build or "CK"
        # FA3 takes head sizes in multiples of 8 (2.6.x: 64/128/256 only) and does not pad them (FA2 does).
        if self.fa3 is not None and spec.device.sm == 90 and spec.mask == NO_MASK and self._fa3_takes(spec.head_dim):
            return "FA3"
        return "FA2" if self.fa2 is not None else "FA3"

    def _mask_reasons(self, spec: CallSpec) -> list[str]:
        out = []
        if spec.mask == KEY_PADDING and spec.mask_dtype != torch.bool:
            out.append("float attention mask not supported (boolean key-padding masks only)")
        if spec.mask == KEY_PADDING and self.fa2 is None:
            out.append("key-padding mask needs flash_attn_varlen_func (FA2), which is not installed")
        return out

    def rocm_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = self._mask_reasons(spec)
        if self.fa2 is None:
            out.append("only FA3 is installed, which has no ROCm build")
        arch = spec.device.arch or "this AMD GPU"
        build = self.rocm_build or "CK"
        covered = spec.device.arch in CK_ARCHS if build == "CK" else spec.device.arch.startswith(TRITON_ARCH_PREFIXES)
        if not covered and not out:
            out.extend(self._undocumented(spec, asked, f"{arch}: no flash-attn kernel for this GPU",
                                          f" ({ROCM_COVERAGE[build]})"))
        return out

    def extra_reasons(self, spec: CallSpec, asked: bool) -> list[str]:
        out = self._mask_reasons(spec)
        if self.fa2 is None and spec.device.sm != 90:
            out.append(f"only FA3 is installed, which needs sm90 (GPU is sm{spec.device.sm})")
        if self.fa2 is None and spec.head_dim % 8:
            out.append(f"head_dim {spec.head_dim} not a multiple of 8 (FA3)")
        elif self.fa2 is None and not self._fa3_takes(spec.head_dim):
            sizes = "/".join(map(str, self.fa3_head_dims()))
            out.append(f"head_dim {spec.head_dim} not {sizes} (FA3 {self.fa3_version}; FA2 is not installed)")
        if spec.dtype == torch.bfloat16 and (spec.device.sm or 0) < 80:
            out.append(f"bf16 needs sm80, GPU is sm{spec.device.sm}")
        sm = spec.device.sm or 0
        if sm < 80 and not out:
            out.extend(self._undocumented(spec, asked, f"GPU sm{sm} < sm80"))
        return out

    def _undocumented(self, spec: CallSpec, asked: bool, why: str, detail: str = "") -> list[str]:
        """A GPU no official build targets: ``why`` (and ``detail``), unless the user asked for
        flash-attn by name and a trial call shows the installed build takes it."""
        if not asked:
            return [why + detail]
        trial = self.trial(spec.device.index, spec.dtype)
        return [f"{why}, and a trial call failed: {trial}"] if trial else []

    def trial(self, index, dtype) -> str:
        """Run one tiny call on an older GPU, once per (device, dtype); '' when the installed build
        takes it, else the kernel's own error."""
        if (index, dtype) not in self.trials:
            try:
                x = torch.randn(1, 8, 1, 64, device=torch.device("cuda", index), dtype=dtype)
                self.fa2.flash_attn_func(x, x, x)
                torch.cuda.synchronize(index)
                self.trials[(index, dtype)] = ""
            except (RuntimeError, ValueError, TypeError) as exc:
                self.trials[(index, dtype)] = failure_text(exc)
        return self.trials[(index, dtype)]

    def runner(self, spec: CallSpec):
        if spec.mask != NO_MASK:
            return self._run_key_padding
        if self.variant(spec) != "FA3":
            return self.run
        return self._run_fa3_contiguous if self.fa3_is_26() else self._run_fa3

    def run(self, q, k, v, mask, scale):
        if mask is not None:
            return self._run_key_padding(q, k, v, mask, scale)
        return self.fa2.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False)

    def _run_fa3(self, q, k, v, mask, scale):
        out = self.fa3.flash_attn_func(q, k, v, softmax_scale=scale)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) from 2.6.2 to 2.8.1

    def _run_fa3_contiguous(self, q, k, v, mask, scale):
        return self._run_fa3(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale)

    def _run_key_padding(self, q, k, v, mask, scale):
        """Pack the valid keys of each batch row and run the varlen kernel; any padding pattern works."""
        b, n, h, d = q.shape
        kv = k.shape[1]
        keep = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))[:, 0, 0, :].expand(b, kv)
        counts = keep.sum(dim=1, dtype=torch.int32)
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(counts, dim=0, out=cu_k[1:])
        cu_q = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
        flat = keep.reshape(-1)
        k_packed = k.reshape(b * kv, h, d)[flat]
        v_packed = v.reshape(b * kv, h, d)[flat]
        out = self.fa2.flash_attn_varlen_func(
            q.reshape(b * n, h, d), k_packed, v_packed, cu_q, cu_k, n, int(counts.max()),
            dropout_p=0.0, softmax_scale=default_scale(scale, d), causal=False,
        )
        return out.reshape(b, n, h, d)
