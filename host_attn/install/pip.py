"""Installing an optional kernel on request: the pip command (prebuilt wheels only, every installed
package held at its version, bounded waits), what a failure means, the import check, the kernel hub's
download and the kernel's self-test (``lib_attn.commands.selftest``), which removes what it installed
when the kernel fails."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

from .probe import (COMFY_KITCHEN_MINIMUM, _release_key, canonical, dist_version, flash_attn_choice, gpu_capability,
                    hub_build_cached, installed_pins, linux, linux_x86_64, python_tag, say, torch_requirement_mismatch,
                    triton_installed)
from .wheels import (BACKENDS, COMFY_KITCHEN_REQUIREMENT, ENGINE_ID, FA4_REQUIREMENT, FLASH_ATTN_WHEEL_URL, HUB_FETCH,
                     HUB_REPOS, PYTORCH_INDEX, SAGE_1_WARNING, SAGE_PYPI, VOLTA_TURING_OPTIONS, XFORMERS_CUDA_MAJORS,
                     XFORMERS_FOR_TORCH, XFORMERS_STABLE_ABI)

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


#: URL schemes a named wheel may come from; anything else (git+https, a folder, a source archive) would be
#: built from source, which this installer never does.
WHEEL_SCHEMES = ("http://", "https://", "file://")


def named_wheel(backend):
    """(the wheel named in the backend's ATTN_WHEEL_* variable or None, why it is refused or None)."""
    value = os.environ.get(backend.wheel_env, "").strip() if backend.wheel_env else ""
    if len(value) > 1 and value[0] == value[-1] and value[0] in "\"'":
        # ``set ATTN_WHEEL_SAGE="C:\my wheels\x.whl"`` in a .bat file keeps the quotes in the value.
        value = value[1:-1].strip()
    if not value:
        return None, None
    has_scheme = "://" in value
    if has_scheme and not value.lower().startswith(WHEEL_SCHEMES):
        return None, (f"{backend.wheel_env}={value} is not a wheel file or URL: pip would build it from source, "
                      "and this installer never builds from source; name a .whl file or an http(s) URL of one")
    if not value.lower().split("?", 1)[0].split("#", 1)[0].endswith(".whl"):
        return None, (f"{backend.wheel_env}={value} is not a wheel (.whl): pip would build a source archive or "
                      "folder from source, and this installer never builds from source; name a .whl file or URL")
    if not has_scheme and not os.path.isfile(value):
        return None, f"{backend.wheel_env}={value}: no such file"
    return value, None


def too_old_gpu(backend, gpu):
    """Why this NVIDIA GPU (``gpu_capability()``) cannot run what the installer would fetch, or None."""
    if gpu is None:
        return None
    major, minor, name = gpu
    sm = major * 10 + minor
    if backend.dist == "flash-attn" and sm < 80:
        return (f"flash-attn's release wheels run on Ampere (sm80) or newer, and this GPU is {name} (sm{sm}). "
                f"For this GPU: {VOLTA_TURING_OPTIONS}")
    if backend.id == "flash-attn-4" and sm < 90:
        return f"FlashAttention-4 runs on Hopper (sm90) and Blackwell, and this GPU is {name} (sm{sm})"
    if backend.id in ("hub-flash-attn2", "hub-sage") and sm < 80 or backend.id == "hub-flash-attn3" and sm != 90:
        need = "Hopper (sm90)" if backend.id == "hub-flash-attn3" else "Ampere (sm80) or newer"
        return f"the kernel hub's build runs on {need}, and this GPU is {name} (sm{sm})"
    return None


def install_plan(backend, torch, python):
    """(requirement, extra pip options, what it is) to ask pip for, or (None, reason, None) when
    there is nothing to ask for."""
    override, refused = named_wheel(backend)
    if refused:
        return None, refused, None
    if override:
        return override, "", f"the wheel named in {backend.wheel_env}"
    gpu = gpu_capability()
    too_old = too_old_gpu(backend, gpu)
    if too_old:
        return None, too_old, None
    if backend.dist == "xformers":
        if torch.hip:
            return None, "this installer only knows xformers' CUDA wheels", None
        # PyTorch's own index (a "+cuXYZ" torch) carries xformers built for that CUDA; PyPI's does not.
        if (torch.cuda and int(torch.cuda.split(".")[0]) not in XFORMERS_CUDA_MAJORS
                and not re.fullmatch(r"cu\d+", torch.local)):
            return None, (f"no xformers release has wheels for CUDA {torch.cuda.split('.')[0]} (this is "
                          f"{torch.describe()}): xformers {XFORMERS_STABLE_ABI[1]}'s extension needs the CUDA "
                          f"{'/'.join(map(str, XFORMERS_CUDA_MAJORS))} runtime, so it would import and then run "
                          "no kernel; set ATTN_WHEEL_XFORMERS to a wheel built for this CUDA, or use sdpa-efficient "
                          "or sdpa-cudnn, which need nothing installed"), None
        pinned = XFORMERS_FOR_TORCH.get(torch.release)
        if gpu is not None and gpu[:2] == (7, 0) and _release_key(pinned or XFORMERS_STABLE_ABI[1]) >= (0, 0, 31):
            return None, (f"xformers 0.0.31 and later have no kernels for this GPU, {gpu[2]} (sm70), and the xformers "
                          f"for {torch.describe()} is one of them; the last with V100 kernels is 0.0.30, the release "
                          "for torch 2.7.0. PyTorch's memory-efficient kernel (sdpa-efficient) runs here with "
                          "nothing to install"), None
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


def write_constraints(held):
    handle, path = tempfile.mkstemp(prefix="attn-hold-", suffix=".txt")
    with os.fdopen(handle, "w", encoding="utf-8") as fh:
        for name, version in sorted(held.items()):
            fh.write(f"{name}=={version}\n")
    return path


def held_conflict(text, held):
    """pip's refusal turned into words when a held package was in the way: ``kernels 0.19.1 needs
    huggingface-hub>=1.32, and huggingface-hub 0.25.2 is installed here``; None otherwise."""
    for line in text.splitlines():
        match = re.search(r"([A-Za-z0-9_.\-]+) ([^\s]+) depends on ([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*([^\s]*)", line)
        if match and canonical(match.group(3)) in held:
            who, version, needed, spec = match.group(1), match.group(2), match.group(3), match.group(5)
            return (f"{who} {version} needs {needed}{spec}, and {needed} {held[canonical(needed)]} is installed "
                    "here")
    return None


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


#: pip's wait for an answer, in seconds, and its retries: an index that accepts connections and never
#: answers costs about ``(retries + 1) * timeout`` per index asked, and after one network failure the launch
#: asks for no further backend.
PIP_TIMEOUT, PIP_RETRIES = 10, 1
#: What ``install`` tells its caller.
DONE, NETWORK = "done", "network"


def install(backend, torch, host, dry_run):
    """Install ``backend`` as the user asked; returns ``NETWORK`` when the package index could not be
    reached (the launch then asks for nothing more), else ``DONE``."""
    if host.skip_install:
        say(backend, "install requested, skipped because of --skip-install")
        return DONE
    if torch is None:
        say(backend, "install requested, but torch is not installed yet; nothing done")
        return DONE
    if not (torch.cuda or torch.hip):
        say(backend, f"install requested, but this is {torch.describe()}: it cannot run here; nothing done")
        return DONE
    before = dist_version(backend.dist)
    if before and backend.id in HUB_REPOS:
        build = hub_build_cached(HUB_REPOS[backend.id], torch)
        if build is not None:
            # the variable may stay set: a launch with everything in place downloads and tests nothing
            say(backend, f"kernels {before} and {HUB_REPOS[backend.id]}'s build for {torch.describe()} ({build.name}) "
                         "are installed; nothing to do")
            return DONE
        return fetch_from_hub(backend, torch, host, dry_run, installed=None)
    if before:
        # Left alone unless built for another torch (known for xformers from its metadata) or too old for
        # what the engine needs of it; to change to another wheel, uninstall the installed one first.
        wrong = torch_requirement_mismatch(backend.dist, torch) or too_old_release(backend, before)
        if not wrong:
            say(backend, f"{before} already installed; nothing to do (uninstall it to install another build)")
            return DONE
    requirement, extra, what = install_plan(backend, torch, host.python)
    if requirement is None:
        say(backend, f"install requested, not installed: {extra}; nothing done")
        return DONE
    # Every installed package stays at its version (the host's pins, torch with them): pip may only add
    # what the kernel needs and is missing, or it changes nothing.
    held = installed_pins(leave_out=(backend.dist,))
    constraints = write_constraints(held)
    torch_held = ", ".join(f"{k}=={v}" for k, v in torch.held.items())
    others = len(held) - len(torch.held)
    holding = f"holding {torch_held}" + (f" and the other {others} installed packages at their versions" if others else "")
    command = " ".join(part for part in (
        "install", "--only-binary=:all:", "--upgrade-strategy", "only-if-needed",
        "--timeout", str(PIP_TIMEOUT), "--retries", str(PIP_RETRIES),
        "-c", _quote(constraints), extra, _quote(requirement)) if part)
    try:
        if dry_run:
            say(backend, f"dry run: pip {command.replace(_quote(constraints), '<every installed package ==its version>')} "
                         f"({holding}); it would install {what}")
            return DONE
        say(backend, f"installing {what} for {torch.describe()}, {holding} (pip waits at most "
                     f"{PIP_TIMEOUT * (PIP_RETRIES + 1)} s for an answer)")
        try:
            host.run_pip(command, f"{backend.label} (prebuilt wheel)")
        except RuntimeError as exc:
            return _say_pip_failure(backend, torch, exc, held)
    finally:
        os.unlink(constraints)
    now = installed_pins()   # read once: each package's metadata lookup scans the whole environment
    moved = {name: (version, now.get(name)) for name, version in held.items() if now.get(name) != version}
    if moved:
        say(backend, "WARNING: pip changed " + ", ".join(f"{n} {a} -> {b or 'removed'}" for n, (a, b) in moved.items()))
    after = dist_version(backend.dist)
    added = sorted(set(now) - set(held) - {canonical(backend.dist)})
    error = _import_check(host.python, backend.module) if after else "not found after the install"
    if error is not None:
        if before is None and after is not None:
            host.pip_uninstall(backend.dist)
            say(backend, f"the installed wheel {after} does not load ({error}); removed it again")
        else:
            say(backend, f"installed, but it does not load ({error})")
        return DONE
    also = f" (with {', '.join(added)}, which it needs)" if added else ""
    say(backend, f"{after} installed and imports{also}; every package installed before kept its version")
    if backend.id in HUB_REPOS:
        return fetch_from_hub(backend, torch, host, dry_run, installed=after)
    passed = self_test(backend, host.python)
    if passed is False:
        _remove_after_failed_test(backend, host, before, after)
    return DONE


def too_old_release(backend, installed):
    """Why an installed release is too old for what the engine needs of it (a reason to replace it), or None."""
    if backend.id == "comfy-kitchen" and _release_key(installed) < _release_key(COMFY_KITCHEN_MINIMUM):
        return f"comfy-kitchen {COMFY_KITCHEN_MINIMUM} or later"
    return None


def _say_pip_failure(backend, torch, exc, held):
    kind, hosts, cause = _pip_failure(exc)
    unchanged = (f"Nothing was changed; torch stays {torch.version}. To use a wheel you have, set "
                 f"{backend.wheel_env}=<file or URL>; the engine uses the other backends meanwhile"
                 if backend.wheel_env else f"Nothing was changed; torch stays {torch.version}")
    if kind == "network":
        where = hosts or "the package index"
        say(backend, f"network failure: could not reach {where} ({cause}), so whether a wheel exists is not "
                     f"known. Check the connection or proxy (pip's own settings, or INDEX_URL) and restart; "
                     f"nothing more is tried in this launch. {unchanged}")
        return NETWORK
    conflict = held_conflict(str(exc), held)
    if conflict:
        say(backend, f"refused: {conflict}, which this installer keeps as it is (the webui pins it; moving it "
                     f"can break the webui). {unchanged}")
    elif kind == "missing":
        say(backend, f"no prebuilt wheel matches {torch.describe()} ({cause}). {unchanged}")
    else:
        say(backend, f"pip failed ({cause}). {unchanged}")
    return DONE


def _remove_after_failed_test(backend, host, before, after):
    if before is None:
        host.pip_uninstall(backend.dist)
        say(backend, f"removed {backend.dist} {after} again, since its kernel failed the self-test; the engine "
                     "uses the other backends")
    else:
        say(backend, f"{backend.dist} {after} replaced {before} and failed the self-test; to go back: "
                     f"pip install {backend.dist}=={before}")


#: The hub download's bounds: the Hugging Face client's own wait for each answer (its environment variables)
#: and the whole download's.
HUB_ANSWER_SECONDS, HUB_DOWNLOAD_SECONDS = 10, 600


def fetch_from_hub(backend, torch, host, dry_run, installed):
    """Download the hub build of ``backend`` for this torch into the cache, then run the self-test.
    ``installed``: the kernels release this launch installed (None when it was there before)."""
    repo = HUB_REPOS[backend.id]
    if dry_run:
        say(backend, f"dry run: kernels' install_kernel({repo!r}) in {host.python}")
        return DONE
    kept = (f"kernels {installed} stays installed (pip uninstall kernels removes it)" if installed
            else "nothing was changed")
    say(backend, f"fetching {repo}'s build for {torch.describe()} from the Hugging Face kernel hub "
                 f"(at most {HUB_DOWNLOAD_SECONDS // 60} minutes)")
    env = dict(os.environ, HF_HUB_ETAG_TIMEOUT=str(HUB_ANSWER_SECONDS), HF_HUB_DOWNLOAD_TIMEOUT=str(HUB_ANSWER_SECONDS))
    try:
        result = subprocess.run([host.python, "-c", HUB_FETCH, repo], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=HUB_DOWNLOAD_SECONDS, env=env)
    except (subprocess.SubprocessError, OSError) as exc:
        say(backend, f"the download did not finish ({exc}); {kept}")
        return DONE
    if result.returncode != 0:
        kind, hosts, cause = _pip_failure(result.stderr.decode(errors="replace"))
        if kind == "network":
            say(backend, f"network failure: could not reach {hosts or 'huggingface.co'} ({cause}); this machine "
                         f"looks offline. {kept[0].upper() + kept[1:]}; PyTorch's own kernels are used meanwhile")
            return NETWORK
        lines = [line for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
        say(backend, f"the hub has no usable build of {repo} for {torch.describe()} "
                     f"({lines[-1].strip() if lines else 'no output'}); {kept}")
        return DONE
    path = result.stdout.decode(errors="replace").strip()
    say(backend, f"{repo} is in the local cache ({path})")
    if self_test(backend, host.python) is False:
        say(backend, f"its build stays in the Hugging Face cache, where the engine finds it; delete {path} to "
                     f"remove it (the engine's guard keeps a failing kernel's calls on the other backends)")
    return DONE


# The kernel itself, strictly, on the host's call shapes, against float64 (lib_attn/commands/selftest.py);
# without a GPU it says so before it loads the engine.
SELF_TEST = """
import sys
import torch
if not torch.cuda.is_available():
    print("skipped: no CUDA device")
    sys.exit(0)
sys.path.insert(0, sys.argv[1])
from lib_attn.commands import selftest
sys.exit(selftest.main(sys.argv[2:]))
"""
#: The self-test's bound: a few calls, but the first one of a kernel may compile (Triton, CuTe DSL).
SELF_TEST_SECONDS = 600


def self_test(backend, python):
    """Run the installed kernel's self-test and say what happened: True (passed), False (failed), None
    (it could not run here: no GPU)."""
    engine_id = ENGINE_ID.get(backend.id, backend.id)
    try:
        result = subprocess.run([python, "-c", SELF_TEST, ROOT, engine_id], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=SELF_TEST_SECONDS)
    except (subprocess.SubprocessError, OSError) as exc:
        say(backend, f"self-test FAILED: it did not finish ({exc})")
        return False
    lines = [line.strip() for line in result.stdout.decode(errors="replace").splitlines() if line.strip()]
    errors = [line.strip() for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]
    text = lines[-1] if lines else (errors[-1] if errors else f"exit status {result.returncode}")
    if result.returncode == 0 and text.startswith("skipped"):
        say(backend, f"self-test {text}")
        return None
    passed = result.returncode == 0
    say(backend, f"self-test {'passed' if passed else 'FAILED'}: {text}")
    return passed
