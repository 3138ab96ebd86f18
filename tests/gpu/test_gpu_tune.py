"""Tuning on a real CUDA device: CUDA-event timings, every fused kernel checked, no tuning in capture."""
from __future__ import annotations

import pytest
import torch

import lib_attn
from lib_attn import check, tune
from lib_attn import tuning_file
from tests.engine_helpers import make_qkv, reference, rel_err

# SD1.5's cross-attention and self-attention at 512², the VAE's single 512-wide head at 256².
CALLS = [("unet", (2, 8, 4096, 77, 40)), ("unet", (2, 8, 1024, 1024, 80)), ("vae", (1, 1, 1024, 1024, 512))]


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning_file.ENV_DIR, str(tmp_path))
    tuning_file.forget_memory()
    lib_attn.reset()
    yield
    lib_attn.reset()
    tuning_file.forget_memory()


@pytest.mark.parametrize("role, shape", CALLS, ids=lambda x: str(x))
def test_auto_tunes_on_a_gpu_and_runs_the_fastest_correct_kernel(role, shape, monkeypatch):
    b, h, n, kv, d = shape
    q, k, v = (t.cuda() for t in make_qkv(b, h, n, kv, d, torch.float16, seed=5))
    assert lib_attn.config().tune == "auto"  # on by default for CUDA devices
    out = lib_attn.attention(q, k, v, role=role)
    dec = lib_attn.explain(q, k, v, role=role)
    assert dec.source == "measured" and dec.timings, str(dec)
    assert dec.backend == min(dec.timings, key=dec.timings.get)
    assert all(0 < t < 1 for t in dec.timings.values())
    assert rel_err(out, reference(q, k, v)) < check.BOUNDS[torch.float16]
    print(f"{role} {shape}: {dec}")
    monkeypatch.setattr(tune, "measure", lambda *a, **kw: pytest.fail("measured again"))
    lib_attn.reset()
    lib_attn.attention(q, k, v, role=role)
    assert lib_attn.explain(q, k, v, role=role).source == "stored"


def test_no_tuning_while_a_cuda_graph_is_captured():
    q, k, v = (t.cuda() for t in make_qkv(1, 8, 256, 77, 64, torch.float16, seed=6))
    lib_attn.attention(q, k, v)  # another signature warms PyTorch up outside the capture
    q2 = q[:, :, :128].contiguous()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            assert tune.blocked("cuda") == "a CUDA graph is being captured"
            out = lib_attn.attention(q2, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(q2, k, v)) < check.BOUNDS[torch.float16]
    lib_attn.attention(q2, k, v)  # outside the capture the signature tunes
    assert lib_attn.explain(q2, k, v).source == "measured"
