"""What is installed, read from package metadata and ``torch/version.py`` without importing torch, and
one line per optional kernel saying whether it is usable and, if not, why and what to do."""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys

from .wheels import (COMFY_KITCHEN_REQUIREMENT, HUB_REPOS, SAGE_1_WARNING, TRITON_DISTS, VOLTA_TURING_OPTIONS,
                     flash_attn_coverage, flash_attn_release)

TAG = "[flash-attention]"  # the runtime's prefix too
COMFY_KITCHEN_MINIMUM = COMFY_KITCHEN_REQUIREMENT.split(">=")[1]


def say(backend, text):
    print(f"{TAG} {backend.label}: {text}", flush=True)



def dist_version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _version_field(text, name):
    match = re.search(rf"^{name}\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


class TorchInfo:
    """What the installed torch is, read from its metadata and torch/version.py."""

    def __init__(self, version, cuda, hip, held):
        self.version = version          # e.g. "2.1.2+cu121"
        self.cuda = cuda                # e.g. "12.1", or None
        self.hip = hip                  # ROCm version, or None
        self.held = held                # {dist: version} pinned during installs

    @property
    def release(self):
        return self.version.split("+", 1)[0]

    @property
    def local(self):
        return self.version.split("+", 1)[1] if "+" in self.version else ""

    def major_minor(self):
        parts = re.findall(r"\d+", self.release)[:2]
        return tuple(int(p) for p in parts) if len(parts) == 2 else (0, 0)

    def describe(self):
        # macOS builds run on the Apple GPU (MPS), which none of these kernels supports either.
        other = "macOS build (MPS)" if platform.system() == "Darwin" else "CPU build"
        runtime = f"CUDA {self.cuda}" if self.cuda else (f"ROCm {self.hip}" if self.hip else other)
        return f"torch {self.version} ({runtime}), Python {sys.version_info[0]}.{sys.version_info[1]}"


def probe_torch():
    version = dist_version("torch")
    if version is None:
        return None
    cuda = hip = None
    spec = importlib.util.find_spec("torch")  # a top-level find_spec does not import the package
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, "version.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            cuda = _version_field(text, "cuda")
            hip = _version_field(text, "hip")
            break
    held = {"torch": version}
    for name in ("torchvision", "torchaudio"):
        other = dist_version(name)
        if other:
            held[name] = other
    return TorchInfo(version, None if cuda in (None, "None") else cuda,
                     None if hip in (None, "None") else hip, held)


def canonical(name):
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_pins(leave_out=()):
    """{name: version} of every distribution installed in this Python, less those in ``leave_out``: what an
    install holds where it is, so that a kernel's own needs never move a package the host pinned."""
    skip = {canonical(n) for n in leave_out}
    pins = {}
    for dist in metadata.distributions():
        name, version = dist.metadata.get("Name"), dist.version
        if not name or not version or canonical(name) in skip or canonical(name) in pins:
            continue
        if _valid_version(version):  # pip refuses a constraint file with a version it cannot read
            pins[canonical(name)] = version
    return pins


def _valid_version(text):
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        try:
            from pip._vendor.packaging.version import InvalidVersion, Version
        except ImportError:
            return bool(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", text))
    try:
        Version(text)
        return True
    except InvalidVersion:
        return False


#: What ``nvidia-smi`` is given at most to answer (it can hang on a driver in a bad state).
GPU_QUERY_SECONDS = 10


@functools.lru_cache(maxsize=None)
def gpu_capability():
    """(major, minor, name) of the first NVIDIA GPU as ``nvidia-smi`` reports it, or None when it cannot
    tell (no driver, another vendor, an old driver without ``compute_cap``). No torch is imported."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=GPU_QUERY_SECONDS)
    except (OSError, subprocess.SubprocessError):
        return None
    first = result.stdout.decode(errors="replace").strip().splitlines()[:1]
    match = re.match(r"\s*(\d+)\.(\d+)\s*,\s*(.*)", first[0]) if first and result.returncode == 0 else None
    return (int(match.group(1)), int(match.group(2)), match.group(3).strip()) if match else None


def hub_build_cached(repo, torch):
    """The kernel hub's cached build of ``repo`` that fits ``torch`` (a ``TorchInfo``), or None: the
    engine's own reading of the cache (``lib_attn/kernels/hub_cache.py``), loaded by its path, since
    importing the lib_attn package would import torch."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "_attn_install_hub_cache", os.path.join(root, "lib_attn", "kernels", "hub_cache.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cached_build(repo, module.build_pattern(torch.version, torch.cuda, torch.hip))


def python_tag():
    return f"cp{sys.version_info[0]}{sys.version_info[1]}"


def triton_installed():
    return any(dist_version(name) for name in TRITON_DISTS)


def linux():
    return platform.system() == "Linux"


def linux_x86_64():
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def flash_attn_choice(torch, abi=None):
    """(release, None) for the flash-attn release whose wheel fits, or (None, why there is none)."""
    if not linux_x86_64():
        return None, (f"flash-attn publishes no prebuilt wheels for {platform.system()} {platform.machine()}; "
                      "set ATTN_WHEEL_FLASH_ATTN to a wheel built for "
                      f"{torch.describe()}, or ATTN_INSTALL=hub-flash-attn2 for the kernel hub's build "
                      "(PyTorch's own SDPA and cuDNN kernels are used meanwhile)")
    if torch.hip:
        return None, "flash-attn's ROCm build is source-only"
    torch_mm = "%d.%d" % torch.major_minor()
    python = "%d.%d" % sys.version_info[:2]
    release = flash_attn_release(torch_mm, int(torch.cuda.split(".")[0]), python, abi)
    if release is None:
        return None, (f"no flash-attn release has a prebuilt wheel for torch {torch_mm} with CUDA "
                      f"{torch.cuda.split('.')[0]} and Python {python} (release wheels: {flash_attn_coverage()}). "
                      "Set ATTN_WHEEL_FLASH_ATTN to a wheel built for "
                      f"{torch.describe()}, or ATTN_INSTALL=hub-flash-attn2 for the kernel hub's build "
                      "(hub-flash-attn3 on Hopper; flash-attn-4 on Hopper and Blackwell); "
                      "PyTorch's own SDPA kernels are used meanwhile")
    return release, None


def _release_key(version):
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+", 1)[0])[:3])


def torch_requirement_mismatch(dist, torch):
    """The `torch` requirement of an installed distribution that the installed torch fails, or None."""
    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        if ";" in line and "extra" in line.split(";", 1)[1]:
            continue
        match = re.match(r"^\s*torch\s*\(?\s*([<>=!~][^;)]*)", line)
        if not match:
            continue
        spec = match.group(1).strip()
        if not _satisfies(torch.version, spec):
            return f"torch{spec}"
    return None


def _satisfies(version, spec):
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        try:
            from pip._vendor.packaging.specifiers import SpecifierSet
            from pip._vendor.packaging.version import Version
        except ImportError:
            return True  # cannot judge; let the engine's own import check decide
    return Version(version) in SpecifierSet(spec, prereleases=True)


def status(backend, torch):
    """One line about an optional backend, from metadata only."""
    installed = dist_version(backend.dist)
    if torch is None:
        return "torch is not installed yet; nothing to check"
    gpu = torch.cuda or torch.hip
    if installed is None:
        if not gpu:
            return (f"not installed; it needs a CUDA build of torch and this is {torch.describe()}: "
                    "the built-in PyTorch kernels are used")
        if torch.hip:
            return ("not installed; this installer only knows NVIDIA wheels, "
                    f"install a ROCm build by hand if you want it ({torch.describe()})")
        head = f"not installed (optional; needs {backend.needs})"
        gpu = gpu_capability()
        if backend.dist == "flash-attn" and gpu is not None and gpu[0] < 8:
            return (f"{head}; not offered: its wheels run on Ampere (sm80) or newer, and this GPU is {gpu[2]} "
                    f"(sm{gpu[0]}{gpu[1]}). For this GPU: {VOLTA_TURING_OPTIONS}")
        if backend.dist == "flash-attn":
            release, why = flash_attn_choice(torch)
            if release is None:
                return f"{head}; {why}"
            return (f"{head}. To install flash-attn {release}'s prebuilt wheel for {torch.describe()}, "
                    f"set ATTN_INSTALL={backend.id} and restart")
        if backend.dist == "sageattention":
            sage1 = ("To install SageAttention 1.0.6 (Triton kernels, from PyPI), set ATTN_INSTALL=sage and restart"
                     if triton_installed() else
                     "SageAttention 1.0.6 from PyPI (ATTN_INSTALL=sage) needs Triton, which is not installed")
            return (f"{head}. {sage1}; for SageAttention 2.2 set ATTN_WHEEL_SAGE as well, to a wheel built "
                    f"for {torch.describe()} (note: {SAGE_1_WARNING.split(', so')[0]})")
        if backend.id == "flash-attn-4":
            if not linux():
                return f"{head}; its CuTe DSL has Linux wheels only, and this is {platform.system()}"
            return (f"{head}. To install FlashAttention-4 from PyPI for {torch.describe()}, "
                    f"set ATTN_INSTALL={backend.id} and restart")
        if backend.id == "comfy-kitchen":
            return (f"{head}. To install comfy-kitchen's wheel from PyPI (INT8 attention and Sol-Attn) for "
                    f"{torch.describe()}, set ATTN_INSTALL={backend.id} and restart")
        if backend.id in HUB_REPOS:
            return (f"{head}. To fetch the kernel hub's {HUB_REPOS[backend.id]} build for {torch.describe()} "
                    f"(the kernels package and one build; nothing is downloaded otherwise), "
                    f"set ATTN_INSTALL={backend.id} and restart")
        return (f"{head}. To install a prebuilt wheel for "
                f"{torch.describe()}, set ATTN_INSTALL={backend.id} and restart")
    if backend.dist == "xformers":
        wrong = torch_requirement_mismatch("xformers", torch)
        if wrong:
            return (f"{installed} is installed but was built for {wrong} and this is torch {torch.version}: "
                    f"it will not load. Set ATTN_INSTALL=xformers to replace it with a matching wheel "
                    "(torch stays as it is)")
    if backend.dist == "sageattention" and not triton_installed():
        return f"{installed} is installed, but Triton is not: sage kernels cannot run without it"
    if backend.dist == "sageattention" and installed.startswith("1."):
        return f"{installed} is installed; {SAGE_1_WARNING}"
    if backend.id == "comfy-kitchen" and _release_key(installed) < _release_key(COMFY_KITCHEN_MINIMUM):
        return (f"{installed} is installed; its INT8 attention and Sol-Attn need {COMFY_KITCHEN_MINIMUM} or later "
                f"(ComfyUI updates it with its requirements; elsewhere: pip install -U comfy-kitchen)")
    if backend.id in HUB_REPOS:
        return (f"kernels {installed} is installed: the engine takes {HUB_REPOS[backend.id]} from the local cache "
                f"when it holds a build for this torch (see the doctor command); ATTN_INSTALL={backend.id} fetches it")
    if not gpu:
        return f"{installed} is installed, but this is {torch.describe()}: it cannot run here"
    return f"{installed} is installed (the engine checks at startup that it loads; see the doctor command)"
