"""Launch-time installer of sd-webui-flash-attention.

The webui runs this file at every launch (a subprocess with the webui root on PYTHONPATH).
By default it installs nothing: it prints one line per optional attention backend saying
whether it is usable and, if not, why and what to do. It reads package metadata only and does
not import torch, so it finishes in a fraction of a second.

Optional backends are installed only on request, through environment variables (set them in
webui-user.bat / webui-user.sh):

  ATTN_INSTALL=flash-attn,xformers,sage   install these, as prebuilt wheels only: flash-attn from
                                           the newest release with a wheel for this torch, xformers
                                           paired with this torch, SageAttention 1.0.6 from PyPI
  ATTN_INSTALL=flash-attn-4                FlashAttention-4 from PyPI (Hopper and Blackwell, Linux)
  ATTN_INSTALL=hub-flash-attn2             the `kernels` package and the Hugging Face kernel hub's
  ATTN_INSTALL=hub-flash-attn3             FA2 / FA3 / SageAttention build for this torch and CUDA
  ATTN_INSTALL=hub-sage                    (builds exist where no wheel does: torch 2.9+, CUDA 13, Windows)
  ATTN_WHEEL_FLASH_ATTN=<file or URL>      use this wheel instead of the default source
  ATTN_WHEEL_XFORMERS=<file or URL>
  ATTN_WHEEL_SAGE=<file or URL>            (SageAttention 2.2 comes only this way)
  ATTN_INSTALL_DRY_RUN=1                   print the pip command, run nothing

Every install runs pip with `--only-binary=:all:` (never a source build) and a constraint file
holding torch, torchvision and torchaudio at their installed versions, so pip either finds a
wheel that fits the installed torch or changes nothing. The result is re-probed and reported, and
a self-test call runs through the engine on the GPU (when there is one) with the backend installed.
This file never exits with an error status for a backend that could not be installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

TAG = "[flash-attention]"  # the runtime's prefix too

# ---------------------------------------------------------------------------------------------
# Known facts about where prebuilt wheels come from. pip, run with the torch constraint, has the
# final word; these facts only choose what to ask it for and what to tell the user.
# ---------------------------------------------------------------------------------------------

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

# FlashAttention-4 on PyPI (`flash-attn-4`, pre-releases only so far): Python and CuTe DSL kernels
# compiled at run time, for Hopper and Blackwell; its `cu13` extra pulls the CUDA 13 build of the
# CuTe DSL. The DSL has Linux wheels only.
FA4_REQUIREMENT = "flash-attn-4{extra}>=4.0.0b1"

# The Hugging Face kernel hub: the `kernels` package downloads a repository's build for the running
# torch, CUDA and platform into the Hugging Face cache, where the engine finds it (never downloading
# anything itself). Builds exist for torch releases flash-attn has no wheel for.
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
ENGINE_ID = {"hub-flash-attn2": "flash-attn", "hub-flash-attn3": "flash-attn", "hub-sage": "sage"}


def say(backend, text):
    print(f"{TAG} {backend.label}: {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# Probing without importing torch
# ---------------------------------------------------------------------------------------------

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
        runtime = f"CUDA {self.cuda}" if self.cuda else (f"ROCm {self.hip}" if self.hip else "CPU build")
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
    if backend.id in HUB_REPOS:
        return (f"kernels {installed} is installed: the engine takes {HUB_REPOS[backend.id]} from the local cache "
                f"when it holds a build for this torch (see the doctor command); ATTN_INSTALL={backend.id} fetches it")
    if not gpu:
        return f"{installed} is installed, but this is {torch.describe()}: it cannot run here"
    return f"{installed} is installed (the engine checks at startup that it loads; see the doctor command)"


# ---------------------------------------------------------------------------------------------
# Installing on request
# ---------------------------------------------------------------------------------------------

def requested_backends(value):
    """Parse ATTN_INSTALL: names separated by commas or spaces. Returns (backends, unknown)."""
    chosen, unknown = [], []
    for name in re.split(r"[,\s]+", value.strip().lower()):
        if not name:
            continue
        match = next((b for b in BACKENDS if name in b.aliases), None)
        if match is None:
            unknown.append(name)
        elif match not in chosen:
            chosen.append(match)
    return chosen, unknown


class Host:
    """The webui's `launch` module when there is one, else the same operations done here."""

    def __init__(self):
        try:
            import launch  # noqa: PLC0415 - the webui root is on PYTHONPATH only when it runs us
        except ImportError:
            launch = None
        self.launch = launch
        if launch is not None:
            self.python = launch.python
            self.skip_install = bool(getattr(launch.args, "skip_install", False))
        else:
            self.python = sys.executable
            argv = sys.argv[1:] + shlex.split(os.environ.get("COMMANDLINE_ARGS", ""))
            self.skip_install = "--skip-install" in argv

    def run_pip(self, command, desc):
        if self.launch is not None:
            return self.launch.run_pip(command, desc)
        line = f'"{self.python}" -m pip {command} --prefer-binary'
        result = subprocess.run(line, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise RuntimeError(f"Couldn't install {desc}.\n{result.stdout.decode(errors='replace')}")
        return result.stdout.decode(errors="replace")

    def pip_uninstall(self, dist):
        line = f'"{self.python}" -m pip uninstall -y {dist}'
        subprocess.run(line, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cxx11_abi(torch, python):
    """torch's C++ ABI flag, asked of torch itself in a child process (install path only)."""
    code = "import torch; print(bool(torch._C._GLIBCXX_USE_CXX11_ABI))"
    try:
        out = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             timeout=300, check=True).stdout.decode().strip()
        return "TRUE" if out == "True" else "FALSE"
    except (subprocess.SubprocessError, OSError):
        # PyPI's torch switched to the new ABI with 2.7.
        return "TRUE" if torch.major_minor() >= (2, 7) else "FALSE"


def install_plan(backend, torch, python):
    """(requirement, extra pip options, what it is) to ask pip for, or (None, reason, None) when
    there is nothing to ask for."""
    override = os.environ.get(backend.wheel_env, "").strip() if backend.wheel_env else ""
    if override:
        return override, "", f"the wheel named in {backend.wheel_env}"
    if backend.dist == "xformers":
        if torch.hip:
            return None, "this installer only knows xformers' CUDA wheels", None
        pinned = XFORMERS_FOR_TORCH.get(torch.release)
        if pinned:
            requirement = f"xformers=={pinned}"
        elif torch.major_minor() >= XFORMERS_STABLE_ABI[0]:
            requirement = f"xformers>={XFORMERS_STABLE_ABI[1]}"
        else:
            requirement = "xformers"
        extra = ""
        if re.fullmatch(r"cu\d+", torch.local):
            extra = f'--extra-index-url {PYTORCH_INDEX.format(variant=torch.local)}'
        return requirement, extra, "a prebuilt wheel"
    if backend.dist == "flash-attn":
        abi = cxx11_abi(torch, python) if linux_x86_64() and not torch.hip else None
        release, why = flash_attn_choice(torch, abi)
        if release is None:
            return None, why, None
        url = FLASH_ATTN_WHEEL_URL.format(ver=release, cuda_major=torch.cuda.split(".")[0],
                                          torch_mm="%d.%d" % torch.major_minor(), abi=abi, py=python_tag())
        return url, "", f"flash-attn {release}'s prebuilt wheel"
    if backend.dist == "sageattention":
        if torch.hip:
            return None, "SageAttention's kernels are for NVIDIA GPUs", None
        if not triton_installed():
            return None, ("SageAttention 1.0.6 from PyPI runs on Triton, which is not installed (install "
                          "triton-windows first on Windows); for SageAttention 2 set ATTN_WHEEL_SAGE to a wheel "
                          f"built for {torch.describe()}"), None
        return SAGE_PYPI, "", f"SageAttention 1.0.6 (Triton kernels; note: {SAGE_1_WARNING})"
    if backend.id == "flash-attn-4":
        if torch.hip:
            return None, "FlashAttention-4 is for NVIDIA GPUs (CuTe DSL)", None
        if not linux():
            return None, f"FlashAttention-4's CuTe DSL has Linux wheels only, and this is {platform.system()}", None
        extra = "[cu13]" if int(torch.cuda.split(".")[0]) >= 13 else ""
        return FA4_REQUIREMENT.format(extra=extra), "", "FlashAttention-4 from PyPI"
    if backend.id in HUB_REPOS:
        if torch.hip:
            return None, "this installer only fetches the hub's CUDA builds", None
        return "kernels", "", "the kernels package (for the kernel hub)"
    return None, "unknown backend", None


def write_constraints(torch):
    handle, path = tempfile.mkstemp(prefix="attn-hold-torch-", suffix=".txt")
    with os.fdopen(handle, "w", encoding="utf-8") as fh:
        for name, version in torch.held.items():
            fh.write(f"{name}=={version}\n")
    return path


def _quote(text):
    # Double quotes work in both sh and cmd.exe, which is what the webui's shell=True uses.
    return f'"{text}"'


# What pip (through requests and urllib3) prints when it could not reach a server, most telling
# first. pip turns an unreachable index into "No matching distribution", so these are looked for
# before the signs of a missing wheel.
NETWORK_SIGNS = ("Temporary failure in name resolution", "Name or service not known",
                 "nodename nor servname", "getaddrinfo failed", "Network is unreachable",
                 "No route to host", "Cannot connect to proxy", "Connection refused", "Connection reset",
                 "timed out", "CERTIFICATE_VERIFY_FAILED", "SSLError", "ProxyError", "NewConnectionError",
                 "Max retries exceeded")
MISSING_SIGNS = ("No matching distribution", "Could not find a version", "ResolutionImpossible",
                 "conflict", "is not a supported wheel", "HTTP error 404", "404 Client Error", "does not exist")


def _pip_failure(error):
    """Why pip failed: ("network", hosts, cause), ("missing", "", pip's line) or ("other", "", line)."""
    text = str(error)
    for sign in NETWORK_SIGNS:
        if sign in text:
            hosts = sorted(set(re.findall(r"host='([^']+)'", text)))
            return "network", ", ".join(hosts), sign
    for sign in MISSING_SIGNS:
        for line in text.splitlines():
            if sign in line:
                return "missing", "", line.strip().removeprefix("stderr: ").removeprefix("ERROR: ").strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Under WEBUI_LAUNCH_LIVE_OUTPUT=1 the webui shows pip's output as it runs and raises without it.
    return "other", "", lines[-1] if len(lines) > 3 else "pip failed; its output is above"


def _import_check(python, module):
    """Import the backend in a fresh interpreter; returns None or the error's last line."""
    try:
        result = subprocess.run([python, "-c", f"import {module}"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        return str(exc)
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {result.returncode}"


def install(backend, torch, host, dry_run):
    if host.skip_install:
        say(backend, "install requested, skipped because of --skip-install")
        return
    if torch is None:
        say(backend, "install requested, but torch is not installed yet; nothing done")
        return
    if not (torch.cuda or torch.hip):
        say(backend, f"install requested, but this is {torch.describe()}: it cannot run here; nothing done")
        return
    before = dist_version(backend.dist)
    if before and backend.id in HUB_REPOS:
        fetch_from_hub(backend, torch, host, dry_run)
        return
    if before:
        # Left alone unless built for another torch (known for xformers from its metadata); to
        # change to another wheel, uninstall the installed one first.
        wrong = torch_requirement_mismatch(backend.dist, torch)
        if not wrong:
            say(backend, f"{before} already installed; nothing to do (uninstall it to install another build)")
            return
    requirement, extra, what = install_plan(backend, torch, host.python)
    if requirement is None:
        say(backend, f"install requested, no prebuilt wheel to ask for: {extra}; nothing done")
        return
    constraints = write_constraints(torch)
    held = ", ".join(f"{k}=={v}" for k, v in torch.held.items())
    command = " ".join(part for part in (
        "install", "--only-binary=:all:", "--upgrade-strategy", "only-if-needed",
        "-c", _quote(constraints), extra, _quote(requirement)) if part)
    try:
        if dry_run:
            say(backend, f"dry run: pip {command} (holding {held}); it would install {what}")
            return
        say(backend, f"installing {what} for {torch.describe()}, holding {held}")
        try:
            host.run_pip(command, f"{backend.label} (prebuilt wheel)")
        except RuntimeError as exc:
            kind, hosts, cause = _pip_failure(exc)
            unchanged = (f"Nothing was changed; torch stays {torch.version}. To use a wheel you have, set "
                         f"{backend.wheel_env}=<file or URL>; the engine uses the other backends meanwhile")
            if kind == "network":
                where = hosts or "the package index"
                say(backend, f"network failure: could not reach {where} ({cause}), so whether a wheel "
                             f"exists is not known. Check the connection or proxy and restart. {unchanged}")
            elif kind == "missing":
                say(backend, f"no prebuilt wheel matches {torch.describe()} ({cause}). {unchanged}")
            else:
                say(backend, f"pip failed ({cause}). {unchanged}")
            return
    finally:
        os.unlink(constraints)
    after_torch = dist_version("torch")
    if after_torch != torch.version:
        say(backend, f"WARNING: torch changed from {torch.version} to {after_torch} during the install")
    after = dist_version(backend.dist)
    error = _import_check(host.python, backend.module) if after else "not found after the install"
    if error is None:
        kept = f"torch stays {torch.version}" if after_torch == torch.version else f"torch is now {after_torch}"
        say(backend, f"{after} installed and imports; {kept}")
        if backend.id in HUB_REPOS:
            fetch_from_hub(backend, torch, host, dry_run)
        else:
            self_test(backend, host.python)
        return
    if before is None and after is not None:
        host.pip_uninstall(backend.dist)
        say(backend, f"the installed wheel {after} does not load ({error}); removed it again")
    else:
        say(backend, f"installed, but it does not load ({error})")


def fetch_from_hub(backend, torch, host, dry_run):
    """Download the hub build of ``backend`` for this torch into the cache, then run the self-test."""
    repo = HUB_REPOS[backend.id]
    if dry_run:
        say(backend, f"dry run: kernels' install_kernel({repo!r}) in {host.python}")
        return
    say(backend, f"fetching {repo}'s build for {torch.describe()} from the Hugging Face kernel hub")
    try:
        result = subprocess.run([host.python, "-c", HUB_FETCH, repo], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=1800)
    except (subprocess.SubprocessError, OSError) as exc:
        say(backend, f"the download did not run ({exc}); nothing was changed")
        return
    if result.returncode != 0:
        kind, hosts, cause = _pip_failure(result.stderr.decode(errors="replace"))
        if kind == "network":
            say(backend, f"network failure: could not reach {hosts or 'huggingface.co'} ({cause}); this machine "
                         "looks offline. Nothing was changed; PyTorch's own kernels are used meanwhile")
        else:
            lines = [line for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
            say(backend, f"the hub has no usable build of {repo} for {torch.describe()} "
                         f"({lines[-1].strip() if lines else 'no output'}); nothing was changed")
        return
    say(backend, f"{repo} is in the local cache ({result.stdout.decode(errors='replace').strip()})")
    self_test(backend, host.python)


# One call through the engine with the backend named, on the GPU, compared with fp32 SDPA. kv=128 and
# head_dim 64 suit every installable kernel (SageAttention 1's head sizes, FA3 2.6's, kv a multiple of 64).
SELF_TEST = """
import sys
root, backend = sys.argv[1], sys.argv[2]
import torch
if not torch.cuda.is_available():
    print("skipped: no CUDA device")
    sys.exit(0)
sys.path.insert(0, root)
import lib_attn
q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.float16)
k = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16)
v = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16)
decision = lib_attn.explain(q, k, v, backend=backend)
if decision.backend != backend:
    why = "; ".join(", ".join(r) for bid, r in decision.rejected if bid == backend)
    print(f"the engine does not take it for a test call on {torch.cuda.get_device_name()}: {why}")
    sys.exit(3)
out = lib_attn.attention(q, k, v, backend=backend)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
err = float((out.float() - ref).abs().max() / ref.abs().max())
name = " ".join(p for p in (decision.backend, decision.variant) if p)
print(f"{name} ran a test call on {torch.cuda.get_device_name()}: relative error {err:.1e} against fp32 SDPA")
sys.exit(0 if err < 0.05 else 4)
"""


def self_test(backend, python):
    """Run one call through the engine with the installed backend; say what happened."""
    engine_id = ENGINE_ID.get(backend.id, backend.id)
    root = os.path.dirname(os.path.abspath(__file__))
    try:
        result = subprocess.run([python, "-c", SELF_TEST, root, engine_id], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        say(backend, f"self-test did not run: {exc}")
        return
    lines = [line.strip() for line in result.stdout.decode(errors="replace").splitlines() if line.strip()]
    errors = [line.strip() for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
    text = lines[-1] if lines else (errors[-1] if errors else f"exit status {result.returncode}")
    if result.returncode == 0 and text.startswith("skipped"):
        say(backend, f"self-test {text}")
        return
    verdict = "passed" if result.returncode == 0 else "FAILED"
    say(backend, f"self-test {verdict}: {text}")


def main():
    torch = probe_torch()
    requested, unknown = requested_backends(os.environ.get("ATTN_INSTALL", ""))
    for name in unknown:
        print(f"{TAG} ATTN_INSTALL: unknown backend '{name}' "
              f"(known: {', '.join(b.id for b in BACKENDS)})", flush=True)
    host = Host() if requested else None
    dry_run = os.environ.get("ATTN_INSTALL_DRY_RUN", "") not in ("", "0")
    for backend in BACKENDS:
        if backend in requested:
            install(backend, torch, host, dry_run)
        else:
            say(backend, status(backend, torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
