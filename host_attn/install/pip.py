"""Installing an optional kernel on request: the pip command (prebuilt wheels only, torch held at its
installed version), what a failure means, the import check, the kernel hub's download and a self-test
call through the engine."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

from .probe import (dist_version, flash_attn_choice, hub_build_cached, linux, linux_x86_64, python_tag, say,
                    torch_requirement_mismatch, triton_installed)
from .wheels import (BACKENDS, COMFY_KITCHEN_REQUIREMENT, ENGINE_ID, FA4_REQUIREMENT, FLASH_ATTN_WHEEL_URL, HUB_FETCH, HUB_REPOS, PYTORCH_INDEX,
                     SAGE_1_WARNING, SAGE_PYPI, XFORMERS_FOR_TORCH, XFORMERS_STABLE_ABI)

#: The extension's folder, which the self-test puts on ``sys.path`` to import the engine.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



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
    if backend.id == "comfy-kitchen":
        if torch.hip:
            return None, "this installer offers comfy-kitchen for CUDA builds of torch only", None
        return COMFY_KITCHEN_REQUIREMENT, "", "comfy-kitchen from PyPI (INT8 attention and Sol-Attn)"
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
        build = hub_build_cached(HUB_REPOS[backend.id], torch)
        if build is not None:
            # the variable may stay set: a launch with everything in place downloads and tests nothing
            say(backend, f"kernels {before} and {HUB_REPOS[backend.id]}'s build for {torch.describe()} ({build.name}) "
                         "are installed; nothing to do")
            return
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
    try:
        result = subprocess.run([python, "-c", SELF_TEST, ROOT, engine_id], stdout=subprocess.PIPE,
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
