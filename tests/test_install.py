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
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_PY = os.path.join(ROOT, "install.py")
WEBUI_ROOT = os.path.join(ROOT, "tests", "doubles", "a1111")
LABELS = ("flash-attn", "xformers", "sageattention")


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
                                  f"class _C:\n    _GLIBCXX_USE_CXX11_ABI = {cxx11_abi!r}\n"),
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


def line_for(output, label):
    lines = [line for line in output.splitlines() if line.startswith(f"[attention] {label}:")]
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
    assert len([line for line in out.splitlines() if line.startswith("[attention]")]) == 3, out
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
    import torch
    for label in LABELS:
        assert f"torch {torch.__version__}" in line_for(out, label)
    assert elapsed < 20  # generous: the point is no torch import, checked above


def test_request_on_cpu_torch_installs_nothing(tmp_path):
    code, out, commands = run_install(sys.executable, tmp_path, None, ATTN_INSTALL="xformers,flash-attn")
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
    assert "no prebuilt wheel matches" in line_for(out, "xformers"), out
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
    assert "--only-binary=:all:" in commands[0]


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
    env.add_torch("2.4.1+cu124", "12.4", cxx11_abi=False)
    py = "cp%d%d" % sys.version_info[:2]

    code, out, commands = run_install(env.python, tmp_path, None, ATTN_INSTALL="flash-attn",
                                      ATTN_INSTALL_DRY_RUN="1")

    assert code == 0, out
    assert commands == []
    line = line_for(out, "flash-attn")
    assert f"flash_attn-2.8.3+cu12torch2.4cxx11abiFALSE-{py}-{py}-linux_x86_64.whl" in line, line
    assert "--only-binary=:all:" in line and "holding torch==2.4.1+cu124" in line, line


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
