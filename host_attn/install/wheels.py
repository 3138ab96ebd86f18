"""Known facts about the optional kernels: where their prebuilt wheels come from, and which ones a
torch, CUDA and Python can take. pip, run with the torch constraint, has the final word; these
facts only choose what to ask it for and what to tell the user."""

from __future__ import annotations

# xformers releases up to 0.0.34 each require one exact torch release (their wheels' metadata
# says `torch==X`); 0.0.35 moved to PyTorch's stable ABI and requires `torch>=2.10`. For a torch
# not listed here pip is asked for any xformers and finds the pair, if there is one, itself.
XFORMERS_FOR_TORCH = {
    "2.1.2": "0.0.23.post1",  # A1111 1.10.1's own pair
    "2.2.0": "0.0.24",
    "2.2.1": "0.0.25",
    "2.2.2": "0.0.25.post1",
    "2.3.0": "0.0.26.post1",
    "2.3.1": "0.0.27",
    "2.4.0": "0.0.27.post2",
    "2.4.1": "0.0.28.post1",
    "2.5.1": "0.0.28.post3",
    "2.6.0": "0.0.29.post3",
    "2.7.0": "0.0.30",  # A1111 dev's pair
    "2.7.1": "0.0.31",
    "2.8.0": "0.0.32.post2",
    "2.9.0": "0.0.33.post1",
    "2.9.1": "0.0.33.post2",
}
XFORMERS_STABLE_ABI = ((2, 10), "0.0.35")
# The CUDA runtimes xformers' published wheels link against (0.0.35's extension needs libcudart.so.12): on a
# torch built for another CUDA major (PyPI's torch 2.11 and later: CUDA 13) it imports with a warning and
# runs no kernel, so the installer asks for none there.
XFORMERS_CUDA_MAJORS = (11, 12)
# CUDA builds of torch from PyTorch's own index carry a "+cuXYZ" suffix; that index also has
# xformers wheels built for the same CUDA.
PYTORCH_INDEX = "https://download.pytorch.org/whl/{variant}"

# flash-attn on PyPI is a source release only (installing it from there compiles CUDA code for
# hours). Its authors attach Linux x86-64 wheels to their GitHub releases, one per CUDA major,
# torch major.minor, C++ ABI flag and CPython version; there are none for Windows. Each release
# covers a few torch releases only, so the installer takes the newest release that has a wheel for
# the torch in use.
FLASH_ATTN_WHEEL_URL = (
    "https://github.com/Dao-AILab/flash-attention/releases/download/v{ver}/"
    "flash_attn-{ver}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{py}-{py}-linux_x86_64.whl"
)


class WheelSet:
    """The wheels attached to one flash-attn release: every combination of the listed CUDA majors,
    torch major.minor versions, Python versions and C++ ABI flags, less the (torch, Python) pairs
    in `missing`."""

    def __init__(self, release, cuda, torch, python, missing=()):
        self.release = release
        self.cuda = cuda
        self.torch = torch
        self.python = python
        self.abi = ("FALSE", "TRUE")  # every release so far builds both
        self.missing = frozenset(missing)

    def has(self, torch_mm, cuda_major, python, abi=None):
        return (cuda_major in self.cuda and torch_mm in self.torch and python in self.python
                and (abi is None or abi in self.abi) and (torch_mm, python) not in self.missing)


_PY_39_313 = ("3.9", "3.10", "3.11", "3.12", "3.13")
_NOT_313 = (("2.2", "3.13"), ("2.3", "3.13"), ("2.4", "3.13"))
# Newest first; only releases that cover something no newer one does. From each release's own
# wheel-building workflow (its test matrix of torch, CUDA and Python), final torch releases only.
FLASH_ATTN_RELEASES = (
    WheelSet("2.8.3.post1", (12,), ("2.4", "2.5", "2.6", "2.7", "2.8"), _PY_39_313, [("2.4", "3.13")]),
    WheelSet("2.7.4", (12,), ("2.1", "2.2", "2.3", "2.4", "2.5", "2.6"), _PY_39_313,
             [("2.1", "3.12"), ("2.1", "3.13"), *_NOT_313]),
    WheelSet("2.7.3", (11, 12), ("2.1", "2.2", "2.3", "2.4", "2.5"), _PY_39_313,
             [("2.1", "3.12"), ("2.1", "3.13"), *_NOT_313]),
)


def flash_attn_release(torch_mm, cuda_major, python, abi=None):
    """The newest flash-attn release with a wheel for this torch major.minor ("2.1"), CUDA major
    (12), Python ("3.10") and C++ ABI flag ("TRUE"/"FALSE", None when not known yet), or None."""
    return next((w.release for w in FLASH_ATTN_RELEASES if w.has(torch_mm, cuda_major, python, abi)), None)


def flash_attn_coverage():
    """Which torch versions the known releases' wheels cover, for a message."""
    return "; ".join(f"{w.release}: torch {w.torch[0]}-{w.torch[-1]}, CUDA "
                     f"{'/'.join(map(str, w.cuda))}, Python {w.python[0]}-{w.python[-1]}"
                     for w in FLASH_ATTN_RELEASES)


# sageattention on PyPI: 1.0.6 is a pure-Python wheel (py3-none-any; its kernels are Triton
# kernels, compiled at run time, so it needs Triton and an NVIDIA GPU, fp16 from sm70). It
# declares no dependencies, so Triton is checked here. SageAttention 2 (CUDA kernels) is not on
# PyPI: it comes from a wheel the user names in ATTN_WHEEL_SAGE.
SAGE_PYPI = "sageattention==1.0.6"
TRITON_DISTS = ("triton", "triton-windows", "pytorch-triton")
# SageAttention 1.0.6 (and 2.0.x's Triton path) leave the padded keys of the last 64-key block in the
# softmax, so the engine refuses its calls whose kv_len is not a multiple of 64; 2.2.0 fixed it.
SAGE_1_WARNING = ("the engine refuses SageAttention 1.0.6 for calls whose kv_len is not a multiple of 64 "
                  "(SD cross-attention's 77 keys among them): it miscomputes them (fixed in 2.2.0), so those "
                  "calls run on another backend; for SageAttention 2.2 set ATTN_WHEEL_SAGE to its wheel")

#: What runs fast on Volta (V100, sm70) and Turing (T4, RTX 20xx, sm75), where flash-attn's wheels do not.
VOLTA_TURING_OPTIONS = (
    "PyTorch's memory-efficient kernel (sdpa-efficient, built into torch, nothing to install); xformers "
    "(ATTN_INSTALL=xformers; on a V100 only up to 0.0.30, the release for torch 2.7.0: 0.0.31 and later have no "
    "sm70 kernels); or a community flash-attn build for sm70/sm75 named in ATTN_WHEEL_FLASH_ATTN (the engine "
    "tries such a build with a trial call before it uses it)")

# FlashAttention-4 on PyPI (`flash-attn-4`, pre-releases only so far): Python and CuTe DSL kernels
# compiled at run time, for Hopper and Blackwell; its `cu13` extra pulls the CUDA 13 build of the
# CuTe DSL. The DSL has Linux wheels only.
FA4_REQUIREMENT = "flash-attn-4{extra}>=4.0.0b1"

# The Hugging Face kernel hub: the `kernels` package downloads a repository's build for the running
# torch, CUDA and platform into the Hugging Face cache, where the engine finds it (never downloading
# anything itself). Builds exist for torch releases flash-attn has no wheel for.
# comfy-kitchen on PyPI (ComfyUI's kernel library; ComfyUI 0.19 and later install it with their
# requirements): wheels per CPython (cp310, cp311, cp312-abi3) for Linux x86-64 and Windows, with the
# compiled CUDA (and HIP) extension inside. The extension reaches tensors through DLPack, and the wheel
# requires no torch release. 0.2.40 is the first with both INT8 attention and Sol-Attn.
COMFY_KITCHEN_REQUIREMENT = "comfy-kitchen>=0.2.40"

HUB_REPOS = {"hub-flash-attn2": "kernels-community/flash-attn2", "hub-flash-attn3": "kernels-community/flash-attn3",
             "hub-sage": "kernels-community/sage-attention"}
HUB_FETCH = """
import sys
from kernels import install_kernel
repo = sys.argv[1]
try:
    path = install_kernel(repo, version=1)
except (TypeError, ValueError):  # releases before kernel versions take a revision
    path = install_kernel(repo, revision="main")
print(path)
"""


class Backend:
    def __init__(self, ident, label, dist, module, aliases, wheel_env, needs):
        self.id = ident          # lib_attn backend id
        self.label = label
        self.dist = dist         # distribution name pip knows
        self.module = module     # module the engine imports
        self.aliases = aliases
        self.wheel_env = wheel_env
        self.needs = needs       # what the backend needs from the GPU (for the status line)


BACKENDS = (
    Backend("flash-attn", "flash-attn", "flash-attn", "flash_attn",
            ("flash-attn", "flash_attn", "flash", "fa", "fa2"), "ATTN_WHEEL_FLASH_ATTN",
            "NVIDIA Ampere (sm80) or newer, fp16/bf16, Linux wheels"),
    Backend("xformers", "xformers", "xformers", "xformers",
            ("xformers", "xf"), "ATTN_WHEEL_XFORMERS",
            "an xformers build made for this exact torch"),
    Backend("sage", "sageattention", "sageattention", "sageattention",
            ("sage", "sageattention", "sage-attention"), "ATTN_WHEEL_SAGE",
            "an NVIDIA GPU and Triton: SageAttention 1 fp16 from sm70, SageAttention 2 from sm80"),
    Backend("flash-attn-4", "flash-attn-4", "flash-attn-4", "flash_attn.cute",
            ("flash-attn-4", "flash_attn_4", "fa4"), "ATTN_WHEEL_FLASH_ATTN_4",
            "NVIDIA Hopper (sm90) or Blackwell (sm100/sm120), fp16/bf16, Linux"),
    Backend("comfy-kitchen", "comfy-kitchen", "comfy-kitchen", "comfy_kitchen",
            ("comfy-kitchen", "comfy_kitchen", "kitchen", "ck", "ck-int8"), "ATTN_WHEEL_COMFY_KITCHEN",
            "an NVIDIA GPU: INT8 attention from Turing (sm75); ComfyUI 0.19 and later install it themselves"),
    Backend("hub-flash-attn2", "kernel hub flash-attn2", "kernels", "kernels",
            ("hub-flash-attn2", "hub", "hub-fa2"), "",
            "the kernels package and a hub build for this torch and CUDA; NVIDIA Ampere (sm80) or newer"),
    Backend("hub-flash-attn3", "kernel hub flash-attn3", "kernels", "kernels",
            ("hub-flash-attn3", "hub-fa3"), "",
            "the kernels package and a hub build for this torch and CUDA; NVIDIA Hopper (sm90)"),
    Backend("hub-sage", "kernel hub sage-attention", "kernels", "kernels",
            ("hub-sage",), "",
            "the kernels package and a hub build for this torch and CUDA; NVIDIA Ampere (sm80) or newer "
            "(its SageAttention 3 on sm120)"),
)
#: The engine backend each installable one is used through.
ENGINE_ID = {"comfy-kitchen": "ck-int8", "hub-flash-attn2": "flash-attn", "hub-flash-attn3": "flash-attn", "hub-sage": "sage"}
