"""install.py, run as the webui runs it: `<python> install.py` with the webui root on PYTHONPATH.

The webui root is the A1111 test double (tests/doubles/a1111), whose `launch.run_pip` really
runs pip. Installs happen in a scratch virtual environment that holds a stand-in torch (files and
metadata only; install.py reads them without importing torch), and pip is pointed at a local
folder of hand-made wheels with every index switched off, so no test reaches a registry or can
touch the torch of the environment running the tests.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import types
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_PY = os.path.join(ROOT, "install.py")
WEBUI_ROOT = os.path.join(ROOT, "tests", "doubles", "a1111")
LABELS = ("flash-attn", "xformers", "sageattention", "flash-attn-4", "comfy-kitchen", "kernel hub flash-attn2", "kernel hub flash-attn3",
          "kernel hub sage-attention")


# ---------------------------------------------------------------------------------------------
# Scratch environment and hand-made packages
# ---------------------------------------------------------------------------------------------

class Env:
    def __init__(self, root):
        self.root = root
        self.python = os.path.join(root, "Scripts" if os.name == "nt" else "bin", "python")
        out = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             stdout=subprocess.PIPE, check=True)
        self.site = out.stdout.decode().strip()

    def dists(self):
        return sorted(n for n in os.listdir(self.site) if n.endswith(".dist-info"))

    def snapshot(self, *names):
        """size, mtime and hash of every file of the given top-level entries."""
        result = {}
        for entry in sorted(os.listdir(self.site)):
            if not any(entry == n or entry.startswith(n + "-") for n in names):
                continue
            for folder, _dirs, files in os.walk(os.path.join(self.site, entry)):
                for name in files:
                    path = os.path.join(folder, name)
                    st = os.stat(path)
                    with open(path, "rb") as fh:
                        digest = hashlib.sha256(fh.read()).hexdigest()
                    result[os.path.relpath(path, self.site)] = (st.st_size, st.st_mtime_ns, digest)
        return result

    def dist_version(self, name):
        out = subprocess.run([self.python, "-c",
                              f"import importlib.metadata as m\ntry: print(m.version({name!r}))\n"
                              "except m.PackageNotFoundError: print('-')"],
                             stdout=subprocess.PIPE, check=True)
        value = out.stdout.decode().strip()
        return None if value == "-" else value

    def add_files(self, dist, version, files, requires=()):
        """Lay a distribution into site-packages as pip would have (files, dist-info, RECORD)."""
        info = f"{dist.replace('-', '_')}-{version}.dist-info"
        contents = dict(files)
        contents[f"{info}/METADATA"] = _metadata(dist, version, requires)
        contents[f"{info}/INSTALLER"] = "pip\n"
        contents[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in contents) + f"{info}/RECORD,,\n"
        for rel, text in contents.items():
            path = os.path.join(self.site, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)

    def add_torch(self, version, cuda, cxx11_abi=False):
        cuda_text = repr(cuda)
        self.add_files("torch", version, {
            "torch/__init__.py": (f"__version__ = {version!r}\n"
                                  f"class _C:\n    _GLIBCXX_USE_CXX11_ABI = {cxx11_abi!r}\n"
                                  "class cuda:\n    is_available = staticmethod(lambda: False)\n"),
            "torch/version.py": (f"__version__ = {version!r}\n"
                                 f"cuda: Optional[str] = {cuda_text}\n"
                                 "hip: Optional[str] = None\n"),
        })


def _metadata(dist, version, requires):
    lines = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def make_wheel(folder, dist, version, files, requires=(), tag="py3-none-any"):
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = _metadata(dist, version, requires)
    contents[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: {tag}\n"
    contents[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in contents) + f"{info}/RECORD,,\n"
    path = os.path.join(folder, f"{norm}-{version}-{tag}.whl")
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in contents.items():
            zf.writestr(rel, text)
    return path


def make_sdist(folder, dist, version, marker):
    """A source release whose build, if anyone ran it, would leave `marker` behind."""
    base = f"{dist}-{version}"
    setup = f"open({marker!r}, 'w').write('built')\nfrom setuptools import setup\nsetup(name={dist!r}, version={version!r})\n"
    path = os.path.join(folder, f"{base}.tar.gz")
    with tarfile.open(path, "w:gz") as tf:
        for name, text in ((f"{base}/setup.py", setup),
                           (f"{base}/PKG-INFO", _metadata(dist, version, ()))):
            data = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
    return path


@pytest.fixture(scope="session")
def template_env(tmp_path_factory):
    """An empty virtual environment that can run the test runner's own pip and setuptools."""
    base = tmp_path_factory.mktemp("template")
    root = str(base / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    tools = base / "tools"
    tools.mkdir()
    # Located through metadata, never imported: importing setuptools here would patch distutils.
    for dist, name in (("pip", "pip"), ("setuptools", "setuptools"), ("setuptools", "_distutils_hack")):
        try:
            path = str(importlib.metadata.distribution(dist).locate_file(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.isdir(path):
            os.symlink(path, tools / name)
    site = Env(root).site
    with open(os.path.join(site, "test-tools.pth"), "w", encoding="utf-8") as fh:
        fh.write(str(tools) + "\n")
    return root


@pytest.fixture
def env(template_env, tmp_path):
    root = str(tmp_path / "venv")
    shutil.copytree(template_env, root, symlinks=True)
    return Env(root)


@pytest.fixture
def wheels(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    return str(folder)


def run_install(python, tmp_path, wheels_dir=None, **env_vars):
    """Run install.py the way the webui does; returns (exit status, stdout, pip commands seen)."""
    log = str(tmp_path / "pip.log")
    if os.path.exists(log):
        os.unlink(log)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "ATTN_")) and k not in ("INDEX_URL", "COMMANDLINE_ARGS")}
    empty = tmp_path / "empty-index"
    empty.mkdir(exist_ok=True)
    env.update({
        "PYTHONPATH": WEBUI_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        "LAUNCH_DOUBLE_PIP_LOG": log,
        "PIP_CONFIG_FILE": os.devnull,       # no site pip configuration
        "PIP_NO_INDEX": "1",                 # no registry at all
        "PIP_FIND_LINKS": wheels_dir or str(empty),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        "INDEX_URL": empty.as_uri(),
    })
    env.update(env_vars)
    result = subprocess.run([python, INSTALL_PY], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600)
    commands = []
    if os.path.exists(log):
        with open(log, encoding="utf-8") as fh:
            commands = [line.strip() for line in fh if line.strip()]
    return result.returncode, result.stdout.decode() + result.stderr.decode(), commands


def line_for(output, label, self_test=False):
    """The last line about ``label``: its self-test line, or (by default) the last one before it."""
    lines = [line for line in output.splitlines() if line.startswith(f"[flash-attention] {label}:")
             and line.startswith(f"[flash-attention] {label}: self-test") == self_test]
    assert lines, output
    return lines[-1]


# ---------------------------------------------------------------------------------------------
# Default: install nothing, one line per backend, fast
# ---------------------------------------------------------------------------------------------

def test_default_run_installs_nothing_and_reports_each_backend(env, wheels, tmp_path):
    env.add_torch("2.1.2+cu121", "12.1")
    make_wheel(wheels, "xformers", "0.0.23.post1", {"xformers/__init__.py": ""}, ["torch==2.1.2"])
    dists, torch_files = env.dists(), env.snapshot("torch")

    code, out, commands = run_install(env.python, tmp_path, wheels)

    assert code == 0, out
    assert commands == []
    for label in LABELS:
        line = line_for(out, label)
        assert "not installed" in line and "ATTN_INSTALL=" in line and "CUDA 12.1" in line, line
    assert len([line for line in out.splitlines() if line.startswith("[flash-attention]")]) == len(LABELS), out
    assert env.dists() == dists
    assert env.snapshot("torch") == torch_files


def test_default_run_with_real_torch_does_not_import_torch(tmp_path):
    started = time.perf_counter()
    code, out, commands = run_install(sys.executable, tmp_path, None, PYTHONPROFILEIMPORTTIME="1")
    elapsed = time.perf_counter() - started
    print(f"install.py default run: {elapsed * 1000:.0f} ms (interpreter start included)")

    assert code == 0, out
    assert commands == []
    imported = {line.rsplit("|", 1)[1].strip() for line in out.splitlines() if line.startswith("import time:")}
    assert imported, "-X importtime output missing"
    assert not {"torch", "launch", "pip"} & imported, sorted(imported)
    # The version pip knows (PyPI's CUDA builds carry no "+cu121" there, unlike torch.__version__).
    for label in LABELS:
        assert f"torch {importlib.metadata.version('torch')}" in line_for(out, label)
    assert elapsed < 20  # generous: the point is no torch import, checked above


def _real_torch_is_a_cpu_build():
    import torch
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


@pytest.mark.parametrize("torch_kind", ["stand-in", "real"])
def test_request_on_cpu_torch_installs_nothing(torch_kind, env, tmp_path):
    if torch_kind == "real":
        if not _real_torch_is_a_cpu_build():
            pytest.skip("the torch running the tests is a CUDA build (PyPI's torch 2.1.2 is)")
        python = sys.executable
    else:
        env.add_torch("2.13.0+cpu", None)
        python = env.python
    code, out, commands = run_install(python, tmp_path, None, ATTN_INSTALL="xformers,flash-attn")
    assert code == 0, out
    assert commands == []
    for label in ("xformers", "flash-attn"):
        line = line_for(out, label)
        assert "CPU build" in line and "nothing done" in line, line


def test_unknown_backend_name_is_named_and_ignored(env, tmp_path):
    env.add_torch("2.1.2+cu121", "12.1")
    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flashy")
    assert code == 0, out
    assert commands == []
    assert "unknown backend 'flashy'" in out and "flash-attn, xformers, sage" in out


def test_installed_xformers_built_for_other_torch_is_reported(env, tmp_path):
    env.add_torch("2.1.2+cu121", "12.1")
    env.add_files("xformers", "0.0.28.post1", {"xformers/__init__.py": ""}, ["torch==2.4.1", "numpy"])
    code, out, commands = run_install(env.python, tmp_path)
    assert code == 0, out
    assert commands == []
    line = line_for(out, "xformers")
    assert "torch==2.4.1" in line and "2.1.2+cu121" in line and "will not load" in line, line


# ---------------------------------------------------------------------------------------------
# On request: prebuilt wheels only, torch held
# ---------------------------------------------------------------------------------------------

def test_requested_backend_without_matching_wheel_ends_cleanly(env, tmp_path):
    env.add_torch("2.1.2+cu121", "12.1")
    dists, torch_files = env.dists(), env.snapshot("torch")

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers")

    assert code == 0, out
    line = line_for(out, "xformers")
    assert "no prebuilt wheel matches torch 2.1.2+cu121" in line and "Nothing was changed" in line, out
    assert len(commands) == 1, commands
    assert "--only-binary=:all:" in commands[0] and " -c " in commands[0], commands
    assert '"xformers==0.0.23.post1"' in commands[0], commands  # the known pair for torch 2.1.2
    assert "holding torch==2.1.2+cu121" in out
    assert env.dists() == dists
    assert env.snapshot("torch") == torch_files


def test_torch_is_held_when_only_a_different_torch_would_fit(env, wheels, tmp_path):
    # torch 2.1.0 has no known xformers pair, so pip is asked for any xformers. The only one
    # offered needs torch 2.4.1, which is offered too: without the hold pip would swap torch.
    env.add_torch("2.1.0+cu121", "12.1")
    make_wheel(wheels, "xformers", "0.0.99", {"xformers/__init__.py": ""}, ["torch==2.4.1"])
    make_wheel(wheels, "torch", "2.4.1", {"torch/__init__.py": "__version__ = '2.4.1'\n"})
    pip_env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=wheels)
    unheld = subprocess.run([env.python, "-m", "pip", "install", "--dry-run", "--only-binary=:all:", "xformers"],
                            env=pip_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout.decode()
    assert re.search(r"Would install .*torch-2\.4\.1", unheld), unheld  # the danger is real
    torch_files = env.snapshot("torch")

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")

    assert code == 0, out
    # pip's reason, with the versions, instead of a bare ResolutionImpossible
    assert "refused: xformers 0.0.99 needs torch==2.4.1, and torch 2.1.0+cu121 is installed here" in line_for(
        out, "xformers"), out
    assert '"xformers"' in commands[0], commands
    assert env.dist_version("torch") == "2.1.0+cu121"
    assert env.dist_version("xformers") is None
    assert env.snapshot("torch") == torch_files


def test_matching_wheel_is_installed_reprobed_and_not_reinstalled(env, wheels, tmp_path):
    env.add_torch("2.1.0+cu121", "12.1")
    make_wheel(wheels, "xformers", "0.0.98", {"xformers/__init__.py": "__version__ = '0.0.98'\n"}, ["torch>=2.1"])
    make_wheel(wheels, "torch", "2.4.1", {"torch/__init__.py": ""})  # a newer torch on offer must not be taken
    torch_files = env.snapshot("torch")

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")

    assert code == 0, out
    assert "0.0.98 installed and imports" in line_for(out, "xformers"), out
    assert env.dist_version("xformers") == "0.0.98"
    assert env.snapshot("torch") == torch_files
    assert len(commands) == 1

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")
    assert code == 0, out
    assert "already installed" in line_for(out, "xformers"), out
    assert commands == []


def test_wheel_that_does_not_load_is_removed_again(env, wheels, tmp_path):
    env.add_torch("2.1.0+cu121", "12.1")
    broken = "raise ImportError('_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    make_wheel(wheels, "xformers", "0.0.97", {"xformers/__init__.py": broken}, ["torch"])

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")

    assert code == 0, out
    line = line_for(out, "xformers")
    assert "does not load" in line and "undefined symbol" in line and "removed it again" in line, line
    assert env.dist_version("xformers") is None
    assert env.dist_version("torch") == "2.1.0+cu121"


def test_source_release_is_never_built(env, wheels, tmp_path):
    env.add_torch("2.4.1+cu124", "12.4")
    env.add_files("triton", "3.0.0", {"triton/__init__.py": ""})  # SageAttention 1 needs it
    marker = str(tmp_path / "BUILT_FROM_SOURCE")
    make_sdist(wheels, "sageattention", "1.0.6", marker)

    # Builds would use the environment's own setuptools, so nothing but install.py stops one.
    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage",
                                      PIP_NO_BUILD_ISOLATION="0")

    assert code == 0, out
    line = line_for(out, "sageattention")
    assert "no prebuilt wheel matches torch 2.4.1+cu124" in line and "ATTN_WHEEL_SAGE" in line, line
    assert not os.path.exists(marker)
    assert env.dist_version("sageattention") is None
    assert "--only-binary=:all:" in commands[0] and '"sageattention==1.0.6"' in commands[0], commands


def test_skip_install_is_respected(env, wheels, tmp_path):
    env.add_torch("2.1.0+cu121", "12.1")
    make_wheel(wheels, "xformers", "0.0.98", {"xformers/__init__.py": ""}, ["torch>=2.1"])

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers",
                                      COMMANDLINE_ARGS="--skip-install")

    assert code == 0, out
    assert "--skip-install" in line_for(out, "xformers"), out
    assert commands == []
    assert env.dist_version("xformers") is None


def test_skip_install_in_the_double_makes_run_pip_a_no_op(env, wheels, tmp_path):
    # The host's own rule (A6), independent of install.py's check.
    make_wheel(wheels, "xformers", "0.0.98", {"xformers/__init__.py": ""}, [])
    code = ("import launch; assert launch.args.skip_install; "
            "print(repr(launch.run_pip('install xformers', 'xformers')))")
    env_vars = dict(os.environ, PYTHONPATH=WEBUI_ROOT, COMMANDLINE_ARGS="--skip-install",
                    PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=wheels)
    out = subprocess.run([env.python, "-c", code], env=env_vars, stdout=subprocess.PIPE, check=True)
    assert out.stdout.decode().strip() == "None"
    assert env.dist_version("xformers") is None


@pytest.mark.skipif(platform.system() == "Windows" or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="flash-attn's release wheels exist for Linux x86_64 only")
def test_flash_attn_asks_for_the_release_wheel_of_this_torch(env, tmp_path):
    env.add_torch("2.5.1+cu124", "12.4", cxx11_abi=True)
    py = "cp%d%d" % sys.version_info[:2]

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn",
                                      ATTN_INSTALL_DRY_RUN="1")

    assert code == 0, out
    assert commands == []
    line = line_for(out, "flash-attn")
    assert (f"v2.8.3.post1/flash_attn-2.8.3.post1+cu12torch2.5cxx11abiTRUE-{py}-{py}-linux_x86_64.whl"
            in line), line
    assert "--only-binary=:all:" in line and "holding torch==2.5.1+cu124" in line, line


@pytest.mark.skipif(platform.system() == "Windows" or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="flash-attn's release wheels exist for Linux x86_64 only")
def test_flash_attn_for_torch_2_1_comes_from_the_last_release_with_its_wheels(env, tmp_path):
    # A1111 1.10.1's stack: PyPI's torch 2.1.2 (a CUDA 12.1 build, no "+cu121" in its metadata).
    env.add_torch("2.1.2", "12.1", cxx11_abi=False)
    py = "cp%d%d" % sys.version_info[:2]

    code, out, commands = run_install(env.python, tmp_path, None)
    status = line_for(out, "flash-attn")
    code2, out2, _ = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn", ATTN_INSTALL_DRY_RUN="1")

    assert code == code2 == 0, out + out2
    line = line_for(out2, "flash-attn")
    if sys.version_info[:2] <= (3, 11):
        assert "flash-attn 2.7.4's prebuilt wheel for torch 2.1.2 (CUDA 12.1)" in status, status
        assert f"v2.7.4/flash_attn-2.7.4+cu12torch2.1cxx11abiFALSE-{py}-{py}-linux_x86_64.whl" in line, line
    else:  # no release built torch 2.1 wheels for Python 3.12 or later
        assert "no flash-attn release has a prebuilt wheel for torch 2.1" in status, status
        assert "no flash-attn release has a prebuilt wheel for torch 2.1" in line and "nothing done" in line, line
    assert "2.8.3" not in line.split("(release wheels:")[0], line


def test_no_flash_attn_release_for_this_torch_is_said_plainly_and_pip_is_not_run(env, tmp_path):
    env.add_torch("2.11.0+cu130", "13.0")

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn")

    assert code == 0, out
    assert commands == []
    line = line_for(out, "flash-attn")
    if platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64"):
        assert "no flash-attn release has a prebuilt wheel for torch 2.11 with CUDA 13" in line, line
        assert "2.8.3.post1: torch 2.4-2.8" in line and "ATTN_WHEEL_FLASH_ATTN" in line, line
    assert "nothing done" in line, line


def _load_installer():
    """The installer's code that the tests call directly, as ``install.py`` runs it (without torch)."""
    from host_attn.install import pip, wheels
    return types.SimpleNamespace(flash_attn_release=wheels.flash_attn_release, _pip_failure=pip._pip_failure)


@pytest.mark.parametrize("torch_mm, cuda, python, abi, release", [
    ("2.8", 12, "3.13", "TRUE", "2.8.3.post1"),
    ("2.6", 12, "3.10", "FALSE", "2.8.3.post1"),
    ("2.4", 12, "3.12", None, "2.8.3.post1"),
    ("2.4", 12, "3.13", None, None),        # torch 2.4 was never built for Python 3.13
    ("2.3", 12, "3.11", "FALSE", "2.7.4"),
    ("2.1", 12, "3.10", "FALSE", "2.7.4"),  # A1111 1.10.1: not 2.8.3, whose wheels start at torch 2.4
    ("2.1", 12, "3.12", None, None),
    ("2.1", 11, "3.10", "TRUE", "2.7.3"),   # the last release with CUDA 11 wheels
    ("2.6", 11, "3.10", None, None),
    ("2.9", 12, "3.12", None, None),
    ("2.8", 13, "3.12", None, None),
    ("2.0", 12, "3.10", None, None),
    ("2.5", 12, "3.10", "SOMETHING", None),
])
def test_flash_attn_release_table(torch_mm, cuda, python, abi, release):
    assert _load_installer().flash_attn_release(torch_mm, cuda, python, abi) == release


@pytest.mark.parametrize("torch_version, requirement", [
    ("2.1.2", "xformers==0.0.23.post1"),
    ("2.4.1+cu124", "xformers==0.0.28.post1"),
    ("2.8.0+cu128", "xformers==0.0.32.post2"),
    ("2.11.0+cu130", "xformers>=0.0.35"),   # 0.0.34 requires torch==2.10.0 exactly
    ("2.5.0+cu124", "xformers"),            # no pair known: pip finds it, with torch held
])
def test_xformers_is_asked_for_the_release_paired_with_this_torch(env, tmp_path, torch_version, requirement):
    env.add_torch(torch_version, "12.4")

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers", ATTN_INSTALL_DRY_RUN="1")

    assert code == 0, out
    assert f'"{requirement}"' in line_for(out, "xformers"), out


def test_flash_attn_wheel_for_another_platform_is_refused(env, wheels, tmp_path):
    env.add_torch("2.4.1+cu124", "12.4")
    wheel = make_wheel(wheels, "flash-attn", "2.8.3", {"flash_attn/__init__.py": ""}, ["torch"],
                       tag="cp27-cp27m-win32")

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash",
                                      ATTN_WHEEL_FLASH_ATTN=wheel)

    assert code == 0, out
    line = line_for(out, "flash-attn")
    assert "no prebuilt wheel matches" in line and "not a supported wheel" in line, line
    assert env.dist_version("flash-attn") is None
    assert env.dist_version("torch") == "2.4.1+cu124"


# ---------------------------------------------------------------------------------------------
# Network failures and missing wheels are told apart
# ---------------------------------------------------------------------------------------------

def _closed_port():
    """A loopback port nothing listens on: connections to it are refused at once."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def not_found_server():
    """A loopback HTTP server that answers 404 to everything; yields its base URL."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's own naming
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _offline(**extra):
    """Environment for a machine without a network: every proxy request is refused at once."""
    proxy = f"http://127.0.0.1:{_closed_port()}"
    return dict(HTTPS_PROXY=proxy, HTTP_PROXY=proxy, https_proxy=proxy, http_proxy=proxy, NO_PROXY="",
                no_proxy="", PIP_RETRIES="0", PIP_TIMEOUT="5", **extra)


def test_flash_attn_without_network_is_reported_as_a_network_failure(env, tmp_path):
    env.add_torch("2.5.1+cu124", "12.4")  # flash-attn 2.8.3.post1 has wheels for it on every Python
    torch_files = env.snapshot("torch")

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn", **_offline())

    assert code == 0, out
    line = line_for(out, "flash-attn")
    if platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64"):
        assert len(commands) == 1 and "flash_attn-2.8.3.post1+cu12torch2.5" in commands[0], commands
        assert "network failure: could not reach github.com (Cannot connect to proxy)" in line, line
        assert "no prebuilt wheel" not in line and "Nothing was changed" in line, line
    assert env.dist_version("flash-attn") is None
    assert env.snapshot("torch") == torch_files


def test_unreachable_index_is_reported_as_a_network_failure(env, tmp_path):
    env.add_torch("2.1.2", "12.1")  # PyPI's build: no "+cu121", so no PyTorch index is added
    index = f"http://127.0.0.1:{_closed_port()}/simple"

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers",
                                      INDEX_URL=index, PIP_NO_INDEX="0", PIP_RETRIES="1", PIP_TIMEOUT="5")

    assert code == 0, out
    assert len(commands) == 1 and f"--index-url {index}" in commands[0], commands
    line = line_for(out, "xformers")
    assert "network failure: could not reach the package index (Connection refused)" in line, line
    assert "no prebuilt wheel" not in line, line
    assert env.dist_version("xformers") is None


def test_missing_wheel_at_a_reachable_server_is_reported_as_missing(env, tmp_path, not_found_server):
    env.add_torch("2.5.1+cu124", "12.4")
    url = f"{not_found_server}/flash_attn-2.7.4-py3-none-any.whl"

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn",
                                      ATTN_WHEEL_FLASH_ATTN=url, PIP_RETRIES="0")

    assert code == 0, out
    assert len(commands) == 1 and url in commands[0], commands
    line = line_for(out, "flash-attn")
    assert "no prebuilt wheel matches torch 2.5.1+cu124" in line and "404" in line, line
    assert "network failure" not in line, line
    assert env.dist_version("flash-attn") is None


# ---------------------------------------------------------------------------------------------
# SageAttention: 1.0.6 from PyPI's pure-Python wheel when Triton is there, 2 from a named wheel
# ---------------------------------------------------------------------------------------------

def test_sage_1_wheel_is_installed_where_triton_is(env, wheels, tmp_path):
    env.add_torch("2.4.1+cu124", "12.4")
    env.add_files("triton", "3.0.0", {"triton/__init__.py": ""})
    make_wheel(wheels, "sageattention", "1.0.6", {"sageattention/__init__.py": "def sageattn(*a, **k): pass\n"})
    make_wheel(wheels, "sageattention", "2.2.0", {"sageattention/__init__.py": ""})  # not on PyPI; not taken

    code, out, commands = run_install(env.python, tmp_path, wheels)
    status = line_for(out, "sageattention")
    assert "SageAttention 1.0.6 (Triton kernels, from PyPI), set ATTN_INSTALL=sage" in status, status
    assert "ATTN_WHEEL_SAGE" in status, status

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage")

    assert code == 0, out
    assert len(commands) == 1 and '"sageattention==1.0.6"' in commands[0], commands
    assert "1.0.6 installed and imports" in line_for(out, "sageattention"), out
    assert env.dist_version("sageattention") == "1.0.6"


def test_sage_without_triton_installs_nothing_and_says_why(env, wheels, tmp_path):
    env.add_torch("2.4.1+cu124", "12.4")
    make_wheel(wheels, "sageattention", "1.0.6", {"sageattention/__init__.py": ""})

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage")

    assert code == 0, out
    assert commands == []
    line = line_for(out, "sageattention")
    assert "runs on Triton, which is not installed" in line and "ATTN_WHEEL_SAGE" in line, line
    assert "nothing done" in line, line
    assert env.dist_version("sageattention") is None


def test_sage_2_comes_from_the_wheel_the_user_names(env, wheels, tmp_path):
    env.add_torch("2.4.1+cu124", "12.4")
    env.add_files("triton", "3.0.0", {"triton/__init__.py": ""})
    make_wheel(wheels, "sageattention", "1.0.6", {"sageattention/__init__.py": ""})
    own = tmp_path / "own"
    own.mkdir()
    wheel = make_wheel(str(own), "sageattention", "2.2.0", {"sageattention/__init__.py": "__version__ = '2.2.0'\n"})

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage", ATTN_WHEEL_SAGE=wheel)

    assert code == 0, out
    assert len(commands) == 1 and wheel in commands[0] and "==1.0.6" not in commands[0], commands
    assert "2.2.0 installed and imports" in line_for(out, "sageattention"), out
    assert env.dist_version("sageattention") == "2.2.0"


# What pip printed in each case (pip 23-25), as the webui's run_pip puts it in its RuntimeError.
_PROXY_REFUSED = ("ERROR: Could not install packages due to an OSError: HTTPSConnectionPool(host='github.com', "
                  "port=443): Max retries exceeded with url: /x.whl (Caused by ProxyError('Cannot connect to "
                  "proxy.', NewConnectionError('<HTTPSConnection>: Failed to establish a new connection: "
                  "[Errno 111] Connection refused')))")
_NO_DNS = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
           "connection broken by 'NewConnectionError('<HTTPSConnection>: Failed to establish a new connection: "
           "[Errno -3] Temporary failure in name resolution')': /simple/xformers/\n"
           "ERROR: Could not find a version that satisfies the requirement xformers==0.0.23.post1 (from versions: none)\n"
           "ERROR: No matching distribution found for xformers==0.0.23.post1")
_NOT_FOUND = ("ERROR: HTTP error 404 while getting https://example.invalid/x.whl\n"
              "ERROR: Could not install requirement flash-attn from https://example.invalid/x.whl because of "
              "HTTP error 404 Client Error: Not Found for url: https://example.invalid/x.whl")


@pytest.mark.parametrize("output, kind, detail", [
    (_PROXY_REFUSED, "network", ("github.com", "Cannot connect to proxy")),
    (_NO_DNS, "network", ("", "Temporary failure in name resolution")),
    (_NOT_FOUND, "missing", "HTTP error 404"),
    ("ERROR: No matching distribution found for xformers==9", "missing", "No matching distribution found"),
    ("ERROR: x-cp27-win32.whl is not a supported wheel on this platform.", "missing", "not a supported wheel"),
])
def test_pip_failures_are_told_apart(output, kind, detail):
    error = RuntimeError(f"Couldn't install x.\nCommand: pip install x\nError code: 1\nstderr: {output}")
    got_kind, hosts, cause = _load_installer()._pip_failure(error)
    assert got_kind == kind
    if kind == "network":
        assert (hosts, cause) == detail
    else:
        assert detail in cause and not cause.startswith(("ERROR", "stderr"))


def test_pip_failure_without_its_output_points_at_the_console():
    # Under WEBUI_LAUNCH_LIVE_OUTPUT=1 the webui shows pip's output live and raises without it.
    error = RuntimeError("Couldn't install x.\nCommand: pip install x\nError code: 1")
    assert _load_installer()._pip_failure(error) == ("other", "", "pip failed; its output is above")


# ---------------------------------------------------------------------------------------------
# 2026 stacks: torch 2.9+, CUDA 13, FlashAttention-4, the kernel hub, the self-test
# ---------------------------------------------------------------------------------------------

def test_self_test_runs_after_an_install_and_says_why_it_could_not_here(env, wheels, tmp_path):
    env.add_torch("2.1.0+cu121", "12.1")
    make_wheel(wheels, "xformers", "0.0.98", {"xformers/__init__.py": "__version__ = '0.0.98'\n"}, ["torch>=2.1"])

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")

    assert code == 0, out
    assert "0.0.98 installed and imports" in line_for(out, "xformers"), out
    assert line_for(out, "xformers", self_test=True) == "[flash-attention] xformers: self-test skipped: no CUDA device"


def test_sage_1_install_and_status_warn_of_its_refused_calls(env, wheels, tmp_path):
    env.add_torch("2.9.1+cu128", "12.8")
    env.add_files("triton", "3.5.0", {"triton/__init__.py": ""})
    make_wheel(wheels, "sageattention", "1.0.6", {"sageattention/__init__.py": "def sageattn(*a, **k): pass\n"})

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage", ATTN_INSTALL_DRY_RUN="1")
    assert "kv_len is not a multiple of 64" in line_for(out, "sageattention") and "fixed in 2.2.0" in out, out

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage")
    assert env.dist_version("sageattention") == "1.0.6"
    code, out, commands = run_install(env.python, tmp_path, wheels)
    status = line_for(out, "sageattention")
    assert status.startswith("[flash-attention] sageattention: 1.0.6 is installed; the engine refuses"), status
    assert "ATTN_WHEEL_SAGE" in status


@pytest.mark.parametrize("torch_version,cuda,requirement", [
    ("2.9.1+cu128", "12.8", "flash-attn-4>=4.0.0b1"),
    ("2.11.0+cu130", "13.0", "flash-attn-4[cu13]>=4.0.0b1"),
])
def test_flash_attn_4_is_asked_of_pypi_with_the_cuda_13_extra_where_needed(env, tmp_path, torch_version, cuda,
                                                                            requirement):
    env.add_torch(torch_version, cuda)

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="fa4", ATTN_INSTALL_DRY_RUN="1")

    assert code == 0, out
    line = line_for(out, "flash-attn-4")
    assert f'"{requirement}"' in line and "--only-binary=:all:" in line, line


def test_torch_2_10_with_cuda_13_is_offered_what_exists(env, tmp_path):
    env.add_torch("2.10.0+cu130", "13.0")

    code, out, commands = run_install(env.python, tmp_path, None)

    assert code == 0, out
    flash = line_for(out, "flash-attn")
    assert "no flash-attn release has a prebuilt wheel for torch 2.10 with CUDA 13" in flash, flash
    assert "ATTN_INSTALL=hub-flash-attn2" in flash and "flash-attn-4" in flash, flash
    assert "ATTN_INSTALL=flash-attn-4" in line_for(out, "flash-attn-4")
    assert "ATTN_INSTALL=hub-flash-attn2" in line_for(out, "kernel hub flash-attn2")
    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers", ATTN_INSTALL_DRY_RUN="1")
    xformers = line_for(out, "xformers")
    assert '"xformers>=0.0.35"' in xformers and "download.pytorch.org/whl/cu130" in xformers, xformers


def kernels_wheel(wheels, install_kernel_body):
    """A stand-in `kernels` with the entry point the installer calls (kernels' install_kernel)."""
    return make_wheel(wheels, "kernels", "0.19.1", {"kernels/__init__.py": (
        "def install_kernel(repo_id, *, revision=None, version=None, **kwargs):\n" + install_kernel_body)})


def test_hub_build_is_fetched_only_when_asked_and_then_self_tested(env, wheels, tmp_path):
    env.add_torch("2.10.0+cu130", "13.0")
    kernels_wheel(wheels, "    assert version == 1, version\n    return '/cache/' + repo_id\n")

    code, out, commands = run_install(env.python, tmp_path, wheels)
    assert commands == [] and env.dist_version("kernels") is None

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub-flash-attn3")

    assert code == 0, out
    assert len(commands) == 1 and '"kernels"' in commands[0], commands
    lines = [line for line in out.splitlines() if line.startswith("[flash-attention] kernel hub flash-attn3:")]
    assert any("kernels-community/flash-attn3 is in the local cache (/cache/kernels-community/flash-attn3)" in line
               for line in lines), out
    assert lines[-1] == "[flash-attention] kernel hub flash-attn3: self-test skipped: no CUDA device", out


def test_hub_fetch_on_an_offline_machine_says_so_and_changes_nothing(env, wheels, tmp_path):
    env.add_torch("2.10.0+cu130", "13.0")
    env.add_files("kernels", "0.19.1", {"kernels/__init__.py": (
        "def install_kernel(repo_id, **kwargs):\n"
        "    raise OSError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded "
        "(Caused by NameResolutionError: Temporary failure in name resolution)\")\n")})

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub")

    assert code == 0, out
    assert commands == []  # kernels is there already: no pip run
    line = line_for(out, "kernel hub flash-attn2")
    assert "network failure: could not reach huggingface.co" in line and "offline" in line, line
    assert "Nothing was changed" in line


# ---------------------------------------------------------------------------------------------
# comfy-kitchen: offered from PyPI outside ComfyUI (ComfyUI 0.19+ installs it itself)
# ---------------------------------------------------------------------------------------------

def test_comfy_kitchen_is_offered_and_installed_from_pypi_with_torch_held(env, wheels, tmp_path):
    env.add_torch("2.10.0+cu130", "13.0")
    make_wheel(wheels, "comfy-kitchen", "0.2.40", {"comfy_kitchen/__init__.py": ""})

    code, out, commands = run_install(env.python, tmp_path, wheels)
    status = line_for(out, "comfy-kitchen")
    assert "not installed" in status and "ATTN_INSTALL=comfy-kitchen" in status, status
    assert "ComfyUI 0.19 and later install it themselves" in status, status

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="ck")

    assert code == 0, out
    assert len(commands) == 1 and '"comfy-kitchen>=0.2.40"' in commands[0], commands
    assert "--only-binary=:all:" in commands[0] and "-c" in commands[0].split(), commands
    assert "0.2.40 installed and imports; every package installed before kept its version" in line_for(
        out, "comfy-kitchen"), out
    assert env.dist_version("comfy-kitchen") == "0.2.40" and env.dist_version("torch") == "2.10.0+cu130"


def test_a_comfy_kitchen_without_the_attention_kernels_is_named_and_replaced_when_asked(env, wheels, tmp_path):
    env.add_torch("2.10.0+cu130", "13.0")
    env.add_files("comfy-kitchen", "0.2.8", {"comfy_kitchen/__init__.py": ""})

    code, out, commands = run_install(env.python, tmp_path, wheels)
    status = line_for(out, "comfy-kitchen")
    assert "0.2.8 is installed; its INT8 attention and Sol-Attn need 0.2.40 or later" in status, status

    make_wheel(wheels, "comfy-kitchen", "0.2.40", {"comfy_kitchen/__init__.py": ""})
    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="comfy-kitchen")
    assert code == 0 and len(commands) == 1, out     # not "nothing to do": the installed one lacks the kernels
    assert "0.2.40 installed and imports" in line_for(out, "comfy-kitchen"), out
    assert env.dist_version("comfy-kitchen") == "0.2.40" and env.dist_version("torch") == "2.10.0+cu130"


def test_a_launch_with_the_hub_build_in_place_downloads_and_tests_nothing(env, wheels, tmp_path):
    """ATTN_INSTALL=hub-* may stay set: once kernels and this torch's build are there, a launch reads the
    cache as the engine does and stops (no pip, no hub, no self-test on the GPU)."""
    env.add_torch("2.10.0+cu130", "13.0")
    fetched = tmp_path / "fetched"
    env.add_files("kernels", "0.19.1", {"kernels/__init__.py": (
        "def install_kernel(repo_id, **kwargs):\n"
        f"    open({str(fetched)!r}, 'w').write(repo_id)\n"
        "    raise OSError('no network here')\n")})
    cache = tmp_path / "hf-hub"
    machine = platform.machine().lower().replace("amd64", "x86_64")
    build = (cache / "kernels--kernels-community--flash-attn2" / "snapshots" / "0123abcd" / "build"
             / f"torch210-cxx11-cu130-{machine}-{platform.system().lower()}")
    build.mkdir(parents=True)

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub-flash-attn2",
                                      HF_HUB_CACHE=str(cache))

    assert code == 0, out
    assert commands == [] and not fetched.exists(), out
    lines = [line for line in out.splitlines() if line.startswith("[flash-attention] kernel hub flash-attn2:")]
    assert lines == [f"[flash-attention] kernel hub flash-attn2: kernels 0.19.1 and kernels-community/flash-attn2's "
                     f"build for torch 2.10.0+cu130 (CUDA 13.0), Python {sys.version_info[0]}.{sys.version_info[1]} "
                     f"({build.name}) are installed; nothing to do"], out

    # a build for another torch is not this one's: then the hub is asked (here: offline, said so)
    build.rename(build.with_name(build.name.replace("torch210", "torch29")))
    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub-flash-attn2",
                                      HF_HUB_CACHE=str(cache))
    assert fetched.exists() and "nothing to do" not in line_for(out, "kernel hub flash-attn2"), out


# ---------------------------------------------------------------------------------------------
# Nothing the host pinned moves; a self-test that can fail; bounded waits; wheels only; old GPUs
# ---------------------------------------------------------------------------------------------

def _freeze(env):
    out = subprocess.run([env.python, "-m", "pip", "list", "--format=freeze"], stdout=subprocess.PIPE,
                         env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"), check=True).stdout.decode()
    return sorted(line for line in out.splitlines() if line.strip())


def test_a_kernel_whose_needs_would_move_a_pinned_package_is_refused_naming_it(env, wheels, tmp_path):
    # A1111 1.10.1 pins huggingface-hub 0.25.2 (its transformers 4.30 needs the old API); kernels 0.19.1
    # needs huggingface-hub >= 1.32, which pip would install over it.
    env.add_torch("2.1.2+cu121", "12.1")
    env.add_files("huggingface-hub", "0.25.2", {"huggingface_hub/__init__.py": "__version__ = '0.25.2'\n"})
    kernels_wheel(wheels, "    return '/cache/build'\n")
    os.rename(os.path.join(wheels, "kernels-0.19.1-py3-none-any.whl"), os.path.join(wheels, "k.tmp"))
    make_wheel(wheels, "huggingface-hub", "2.4.0", {"huggingface_hub/__init__.py": ""})
    os.rename(os.path.join(wheels, "k.tmp"), os.path.join(wheels, "kernels-0.19.1-py3-none-any.whl"))
    # the stand-in kernels wheel declares what kernels 0.19.1 declares of the hub client
    rebuilt = make_wheel(wheels, "kernels", "0.19.1", {"kernels/__init__.py": "def install_kernel(*a, **k):\n    return 'x'\n"},
                         ["huggingface-hub>=1.32"])
    assert os.path.exists(rebuilt)
    before = _freeze(env)

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub-flash-attn2")

    assert code == 0 and len(commands) == 1, out
    line = line_for(out, "kernel hub flash-attn2")
    assert ("refused: kernels 0.19.1 needs huggingface-hub>=1.32, and huggingface-hub 0.25.2 is installed here" in line
            and "Nothing was changed" in line), out
    assert _freeze(env) == before
    assert env.dist_version("huggingface-hub") == "0.25.2" and env.dist_version("kernels") is None


def test_an_older_release_that_fits_the_pins_is_taken_and_nothing_installed_moves(env, wheels, tmp_path):
    env.add_torch("2.1.2+cu121", "12.1")
    env.add_files("huggingface-hub", "0.25.2", {"huggingface_hub/__init__.py": ""})
    make_wheel(wheels, "huggingface-hub", "2.4.0", {"huggingface_hub/__init__.py": ""})
    make_wheel(wheels, "kernels", "0.19.1", {"kernels/__init__.py": ""}, ["huggingface-hub>=1.32"])
    make_wheel(wheels, "kernels", "0.4.4", {"kernels/__init__.py": (
        "def install_kernel(repo_id, **kwargs):\n    return '/cache/' + repo_id\n")},
        ["huggingface-hub>=0.20", "packaging>=20"])
    make_wheel(wheels, "packaging", "24.2", {"packaging/__init__.py": ""})
    before = dict(line.split("==") for line in _freeze(env))

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="hub-flash-attn2")

    assert code == 0, out
    assert env.dist_version("kernels") == "0.4.4" and env.dist_version("huggingface-hub") == "0.25.2", out
    after = dict(line.split("==") for line in _freeze(env))
    assert {k: v for k, v in after.items() if k in before} == before
    assert "kernel hub flash-attn2: 0.4.4 installed and imports (with packaging, which it needs)" in out, out


def test_a_self_test_that_fails_removes_the_kernel_it_installed_and_quotes_the_error(env, wheels, tmp_path):
    # A torch that says it has a GPU, where the engine cannot run: the self-test fails as a kernel that
    # raises would, and what it installed goes again.
    env.add_torch("2.1.2+cu121", "12.1")
    torch_init = os.path.join(env.site, "torch", "__init__.py")
    with open(torch_init, "a", encoding="utf-8") as fh:
        fh.write("cuda.is_available = staticmethod(lambda: True)\n")
    make_wheel(wheels, "xformers", "0.0.23.post1", {"xformers/__init__.py": ""}, ["torch==2.1.2"])

    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="xformers")

    assert code == 0, out
    test_line = line_for(out, "xformers", self_test=True)
    assert test_line.startswith("[flash-attention] xformers: self-test FAILED: ") and "Error" in test_line, out
    assert "removed xformers 0.0.23.post1 again, since its kernel failed the self-test" in out, out
    assert env.dist_version("xformers") is None


@pytest.fixture
def silent_server():
    """A loopback server that accepts connections and never answers; yields its base URL."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/simple"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_an_index_that_never_answers_costs_one_bounded_wait_per_launch(env, tmp_path, silent_server):
    env.add_torch("2.1.2", "12.1")
    started = time.monotonic()
    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers,comfy-kitchen",
                                      INDEX_URL=silent_server, PIP_NO_INDEX="0")
    took = time.monotonic() - started

    assert code == 0, out
    assert took < 45, (took, out)            # pip's 2 x 10 s for the one index asked, and no second backend
    assert "network failure" in line_for(out, "xformers") and "nothing more is tried" in line_for(out, "xformers")
    assert "not tried: the package index did not answer" in line_for(out, "comfy-kitchen"), out
    assert len(commands) == 1


@pytest.mark.parametrize("named", ["sageattention-2.2.0.tar.gz", "folder", "git+https://example.invalid/sage.git"])
def test_a_named_source_archive_folder_or_vcs_url_is_refused_before_pip_runs(env, wheels, tmp_path, named):
    env.add_torch("2.5.1+cu124", "12.4")
    if named.endswith(".tar.gz"):
        named = make_sdist(wheels, "sageattention", "2.2.0", str(tmp_path / "built"))
    elif named == "folder":
        named = str(tmp_path)
    code, out, commands = run_install(env.python, tmp_path, wheels, ATTN_INSTALL="sage", ATTN_WHEEL_SAGE=named)
    assert code == 0 and commands == [], out
    line = line_for(out, "sageattention")
    assert "ATTN_WHEEL_SAGE=" in line and "never builds from source" in line, line
    assert not os.path.exists(tmp_path / "built") and env.dist_version("sageattention") is None


def _fake_gpu(tmp_path, answer):
    """A folder holding an ``nvidia-smi`` that reports one GPU as ``answer`` (compute_cap, name)."""
    folder = tmp_path / "smi"
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho '{answer}'\n")
    tool.chmod(0o755)
    return str(folder) + os.pathsep + os.environ.get("PATH", "")


@pytest.mark.skipif(os.name == "nt", reason="a shell script stands in for nvidia-smi")
def test_a_turing_gpu_is_not_offered_flash_attn_and_is_told_its_options(env, tmp_path):
    env.add_torch("2.5.1+cu124", "12.4")
    path = _fake_gpu(tmp_path, "7.5, Tesla T4")
    code, out, commands = run_install(env.python, tmp_path, None, PATH=path)
    status = line_for(out, "flash-attn")
    assert "not offered" in status and "Tesla T4 (sm75)" in status and "ATTN_INSTALL=flash-attn" not in status
    assert "sdpa-efficient" in status and "ATTN_WHEEL_FLASH_ATTN" in status and "xformers" in status

    code, out, commands = run_install(env.python, tmp_path, None, PATH=path, ATTN_INSTALL="flash-attn")
    assert code == 0 and commands == [], out
    line = line_for(out, "flash-attn")
    assert "Ampere (sm80) or newer, and this GPU is Tesla T4 (sm75)" in line and "nothing done" in line, line


@pytest.mark.skipif(os.name == "nt", reason="a shell script stands in for nvidia-smi")
def test_a_v100_is_not_given_an_xformers_without_its_kernels(env, tmp_path):
    env.add_torch("2.8.0+cu128", "12.8")
    code, out, commands = run_install(env.python, tmp_path, None, PATH=_fake_gpu(tmp_path, "7.0, Tesla V100-SXM2-32GB"),
                                      ATTN_INSTALL="xformers")
    assert code == 0 and commands == [], out
    line = line_for(out, "xformers")
    assert "0.0.31 and later have no kernels for this GPU, Tesla V100-SXM2-32GB (sm70)" in line, line


def test_pypi_torch_for_cuda_13_is_not_given_an_xformers_for_cuda_12(env, tmp_path):
    env.add_torch("2.11.0", "13.0")
    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="xformers")
    assert code == 0 and commands == [], out
    assert "no xformers release has wheels for CUDA 13" in line_for(out, "xformers"), out


@pytest.mark.parametrize("quote", ['"', "'"])
def test_a_wheel_path_named_in_quotes_as_a_bat_file_keeps_them_is_taken(tmp_path, monkeypatch, quote):
    from host_attn.install.pip import named_wheel
    wheel = tmp_path / "my wheels" / "sageattention-2.2.0-cp310-cp310-win_amd64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    backend = types.SimpleNamespace(wheel_env="ATTN_WHEEL_SAGE")
    monkeypatch.setenv("ATTN_WHEEL_SAGE", f"{quote}{wheel}{quote}")
    assert named_wheel(backend) == (str(wheel), None)
    monkeypatch.setenv("ATTN_WHEEL_SAGE", f'{quote}{tmp_path}{quote}')  # a folder, quoted: still refused
    found, why = named_wheel(backend)
    assert found is None and "never builds from source" in why
