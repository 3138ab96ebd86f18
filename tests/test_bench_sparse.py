"""``python -m lib_attn bench --sparse``: the comparison it prints and records, its errors against float64 on
local and diffuse inputs, and the arguments it refuses."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from lib_attn.commands.bench import sparse as sparse_bench
from lib_attn.kernels.block_sparse import flex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_call_compared_on_local_and_diffuse_inputs(monkeypatch):
    monkeypatch.setattr(flex, "available", lambda: False)  # the gather design: no compile in a test
    calls = [("1x2048x2x32", 1, 2, 32, (8, 16, 16))]
    # a budget this small call's local inputs meet (2,048 tokens: 16 blocks, coarse shares)
    doc = sparse_bench.run(calls, torch.float32, torch.device("cpu"), 2, 0.2, sparse_bench.DEFAULT_SETTINGS + ", budget=0.3")
    (res,) = doc["results"]
    local, diffuse = res["inputs"]["local"], res["inputs"]["diffuse"]
    assert res["design"] == "gather" and res["shape"] == [1, 2048, 2, 32]
    for entry in (local, diffuse):
        assert set(entry["median_s"]) == {"dense", "kernel", "engine"} and all(entry["median_s"].values())
        assert entry["error"]["dense"] < 1e-5 and 0 < entry["kept"] <= 0.2
    # local attention: the kernel's error is small and the engine ran it sparse within its budget
    assert local["error"]["kernel"] < 0.75 * diffuse["error"]["kernel"]
    assert local["engine"]["sparse_calls"] >= 1 and local["engine"]["reported_error"] <= 0.3
    assert local["error"]["engine"] <= 0.3
    # diffuse attention: the engine kept it dense, over budget, with the dense output
    assert diffuse["engine"]["sparse_calls"] == 0
    assert any(reason.startswith("over budget") for reason in diffuse["engine"]["dense"])
    assert diffuse["error"]["engine"] < 1e-5
    text = sparse_bench.render(doc)
    assert "1x2048x2x32" in text and "kept" in text and "over budget" in text
    # error against the share of blocks kept, routed blocks alone and with the pooled term, per inputs
    shares = res["share_errors"]
    assert set(shares) == {"local", "rope", "diffuse"} and "error against float64 by share" in text
    for name, entries in shares.items():
        kept = [e["kept"] for e in entries]
        assert kept == sorted(kept) and entries[-1]["pooled"] < entries[0]["pooled"]
        assert all(e["pooled"] <= e["routed"] * 1.05 for e in entries)
    assert shares["local"][3]["pooled"] < 0.75 * shares["diffuse"][3]["pooled"]


def test_progress_is_told_at_each_step_and_while_a_step_runs():
    stream = io.StringIO()
    with sparse_bench.Progress(stream, every=0.05) as progress:
        progress.step("dense first call")
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 4 and all(line.startswith("bench --sparse: dense first call (") for line in lines)


@pytest.mark.parametrize("args, words", [
    (["--sparse-call", "1x100"], "write BxNxHxD"),
    (["--sparse-topk", "0"], "must be in (0, 1]"),
    (["--sparse-settings", "block-sparse, budget=3"], "budget '3'"),
    (["--model", "sdxl"], "no long self-attention call"),
    (["--sparse-call", "1x1024x1x16", "--sparse-grid", "4x16x15"], "holds 960 tokens, the call 1024"),
    (["--sparse-call", "1x1024x1x16", "--sparse-grid", "4x16"], "holds 64 tokens"),
    (["--sparse-call", "1x1024x1x16", "--sparse-grid", "4xax16"], "write FxHxW"),
    (["--sparse-grid", "4x16x16"], "--sparse-grid needs --sparse-call"),
])
def test_bad_arguments_are_refused_naming_them(args, words):
    done = subprocess.run([sys.executable, "-m", "lib_attn", "bench", "--sparse", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_video_calls_are_scaled_on_their_grid():
    calls = sparse_bench.calls_for(["wan"], 720, 8)
    (label, b, heads, head_dim, grid), = calls
    assert label == "wan self 720p ÷8" and (b, heads, head_dim) == (1, 5, 128)
    frames, h, w = grid
    assert frames == 21 and abs(frames * h * w - 75600 / 8) / (75600 / 8) < 0.1
    assert json.dumps(calls)  # plain data, for --json


def test_the_chart_holds_error_against_share_for_both_designs_on_each_input(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from lib_attn.commands import bench

    shares = {name: [{"topk": t, "kept": t, "routed": 2.0 * base / t, "pooled": base / t} for t in (0.1, 0.2, 0.5)]
              for name, base in (("local", 0.01), ("rope", 0.05), ("diffuse", 0.2))}
    doc = {"dtype": "float32", "settings": sparse_bench.DEFAULT_SETTINGS + ", budget=0.06",
           "results": [{"call": "1x2048x2x32", "shape": [1, 2048, 2, 32], "grid": [8, 16, 16], "share_errors": shares}]}
    path = tmp_path / "sparse.png"
    series = bench.plot_sparse(doc, str(path))
    image = Image.open(path)
    assert image.format == "PNG" and image.size[0] > 300
    held = image.text["Series"].split("; ")
    assert held == series and len(series) == 6
    for name in shares:  # each kind of input, as the routed blocks alone and with the pooled term
        assert {f"{name}: routed blocks alone", f"{name}: with the pooled term (block-sparse)"} <= set(held)


def test_sparse_bench_writes_its_chart_from_the_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = tmp_path / "run.png"
    done = subprocess.run([sys.executable, "-m", "lib_attn", "bench", "--sparse", "--sparse-call", "1x1024x1x16",
                           "--sparse-grid", "4x16x16", "--sparse-rounds", "1", "--sparse-settings", "block-sparse, min_tokens=1, dense=none, budget=0.5",
                           "--plot", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert f"chart written to {path}" in done.stdout and "on grid 4x16x16" in done.stdout
    series = Image.open(path).text["Series"].split("; ")
    assert any(s.startswith("local: routed") for s in series) and any(s.startswith("diffuse: with the pooled") for s in series)
