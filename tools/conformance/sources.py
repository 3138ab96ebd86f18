"""The released packages the conformance cases run, fetched from PyPI at test time and never committed.

``fetch("flash-attn", "2.8.3")`` runs ``python -m pip download --no-deps`` into ``.conformance-cache/``
at the repository root, unpacks the file once, and returns the folder that holds the package's
Python (the sdist's top folder, or the unpacked wheel); of an sdist only the Python and text files
are unpacked (the CUDA sources and third-party trees are most of its size and never run here). A
failure raises ``FetchError`` with pip's own last lines. flash-attn's and xformers' setup.py import torch even to say what they are, so
sdists are downloaded without build isolation (the running Python has torch) and with flash-attn's
``FLASH_ATTENTION_SKIP_CUDA_BUILD`` set, which keeps its setup.py from looking for CUDA.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = ROOT / ".conformance-cache"
KINDS = ("sdist", "wheel")
#: What is unpacked of an sdist.
SDIST_KEEP = (".py", ".pyi", ".txt", ".json", ".cfg", ".toml", "PKG-INFO")


class FetchError(RuntimeError):
    pass


def _pip_options(kind: str) -> list[str]:
    if kind == "sdist":
        return ["--no-binary", ":all:", "--no-build-isolation"]
    return ["--only-binary", ":all:"]


def _archive(folder: pathlib.Path) -> pathlib.Path | None:
    files = sorted(p for p in folder.iterdir() if p.name.endswith((".tar.gz", ".zip", ".whl")))
    return files[0] if files else None


def _unpack(archive: pathlib.Path, into: pathlib.Path) -> None:
    tmp = into.with_name(into.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and ".." not in m.name.split("/")
                       and not m.name.startswith("/") and m.name.endswith(SDIST_KEEP)]
            tar.extractall(tmp, members=members)
    else:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name.startswith("/") or ".." in name.split("/"):
                    raise FetchError(f"{archive.name}: unsafe path {name!r} in the archive")
            zf.extractall(tmp)
    tmp.rename(into)


def fetch(dist: str, version: str, kind: str = "sdist") -> pathlib.Path:
    """The unpacked release ``dist==version`` (``kind`` "sdist" or "wheel"): its package root."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    base = CACHE / f"{dist}-{version}-{kind}"
    download = base / "download"
    unpacked = base / "unpacked"
    if not unpacked.is_dir():
        download.mkdir(parents=True, exist_ok=True)
        if _archive(download) is None:
            env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE", XFORMERS_DISABLE_FLASH_ATTN="1",
                       PIP_DISABLE_PIP_VERSION_CHECK="1")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--pre", *_pip_options(kind),
                   "-d", str(download), f"{dist}=={version}"]
            result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode != 0 or _archive(download) is None:
                tail = "\n".join(result.stdout.strip().splitlines()[-8:])
                raise FetchError(f"could not download {dist}=={version} ({kind}) with {' '.join(cmd[2:])}:\n{tail}")
        _unpack(_archive(download), unpacked)
    if kind == "wheel":
        return unpacked
    tops = [p for p in unpacked.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise FetchError(f"{dist}=={version}: expected one top folder in the sdist, found {[p.name for p in tops]}")
    return tops[0]
