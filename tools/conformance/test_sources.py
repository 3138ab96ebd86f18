"""sources.fetch: one download and one unpack per release, and a clear error when pip finds nothing."""
from __future__ import annotations

import tarfile

import pytest

from . import sources


def test_a_release_pip_cannot_find_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CACHE", tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing to find: no network is asked
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(sources.FetchError) as err:
        sources.fetch("flash-attn", "0.0.0.dev0")
    text = str(err.value)
    assert text.startswith("could not download flash-attn==0.0.0.dev0 (sdist)") and "--no-binary" in text, text


def test_a_bad_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="kind 'egg' is not one of sdist, wheel"):
        sources.fetch("xformers", "0.0.35", kind="egg")


def test_a_downloaded_sdist_is_unpacked_once_and_keeps_its_python(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CACHE", tmp_path)
    download = tmp_path / "demo-1.0-sdist" / "download"
    download.mkdir(parents=True)
    src = tmp_path / "src" / "demo-1.0"
    (src / "demo").mkdir(parents=True)
    (src / "demo" / "__init__.py").write_text("X = 1\n")
    (src / "csrc").mkdir()
    (src / "csrc" / "kernel.cu").write_text("// CUDA\n")
    with tarfile.open(download / "demo-1.0.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="demo-1.0")

    root = sources.fetch("demo", "1.0")  # the archive is there: pip is not run

    assert root.name == "demo-1.0" and (root / "demo" / "__init__.py").read_text() == "X = 1\n"
    assert not (root / "csrc" / "kernel.cu").exists()
    (root / "demo" / "__init__.py").write_text("X = 2\n")
    assert (sources.fetch("demo", "1.0") / "demo" / "__init__.py").read_text() == "X = 2\n"  # not unpacked again
