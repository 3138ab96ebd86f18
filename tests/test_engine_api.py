"""The engine's public API: bad input, configuration, counters, per-call fallback, strict mode."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import lib_attn
from lib_attn.kernels import REGISTRY
from tests.engine_helpers import make_qkv, reference, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_engine():
    lib_attn.reset()
    yield
    lib_attn.reset()


# --- bad input -----------------------------------------------------------------------------------

def qkv():
    return make_qkv(2, 4, 16, 24, 40, torch.float32)


@pytest.mark.parametrize("mutate, words", [
    (lambda q, k, v: (q[0], k, v), ["q", "4-D"]),
    (lambda q, k, v: (q, k[:1], v[:1]), ["batch"]),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), ["heads"]),
    (lambda q, k, v: (q, k[..., :20], v), ["head_dim"]),
    (lambda q, k, v: (q, k, v[:, :, :5]), ["sequence length"]),
    (lambda q, k, v: (q, k.double(), v), ["dtype"]),
    (lambda q, k, v: (q, k.to("meta"), v), ["device"]),
    (lambda q, k, v: (q[:, :, :0], k, v), ["empty"]),
    (lambda q, k, v: (q.int(), k.int(), v.int()), ["dtype"]),
    (lambda q, k, v: ("q", k, v), ["torch.Tensor"]),
])
def test_bad_tensors_raise_value_error_before_any_kernel(mutate, words, monkeypatch):
    for backend in REGISTRY.values():
        monkeypatch.setattr(backend, "runner", lambda spec: pytest.fail("a kernel was chosen"))
    q, k, v = mutate(*qkv())
    with pytest.raises(ValueError) as err:
        lib_attn.attention(q, k, v)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs, words", [
    (dict(layout="bsdh"), ["layout", "bhsd"]),
    (dict(role="clip"), ["role", "unet"]),
    (dict(backend="flash"), ["flash", "valid ids", "flash-attn"]),
    (dict(fp32="half"), ["fp32"]),
    (dict(mask=torch.ones(2, 4, 16, 23, dtype=torch.bool)), ["mask shape", "(2, 4, 16, 24)"]),
    (dict(mask=torch.ones(2, 4, 16, 24, dtype=torch.int64)), ["mask", "bool"]),
    (dict(mask=torch.ones(1, 2, 4, 16, 24, dtype=torch.bool)), ["mask shape"]),
])
def test_bad_arguments_raise_value_error(kwargs, words):
    with pytest.raises(ValueError) as err:
        lib_attn.attention(*qkv(), **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_cached_signature_still_checks_new_bad_input():
    q, k, v = qkv()
    lib_attn.attention(q, k, v)
    with pytest.raises(ValueError):
        lib_attn.attention(q, k.double(), v)


def test_nan_input_gives_what_pytorch_gives():
    q, k, v = qkv()
    q[0, 0, 0, 0] = float("nan")
    out = lib_attn.attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(want))


# --- configuration -------------------------------------------------------------------------------

def test_configure_and_use_restore_on_exception():
    before = lib_attn.config()
    with pytest.raises(KeyError):
        with lib_attn.use(preference=["math"], fp32="keep", strict=True):
            assert lib_attn.config().preference["unet"] == ("math",)
            assert lib_attn.config().fp32 == "keep" and lib_attn.config().strict
            raise KeyError("boom")
    assert lib_attn.config() == before


def test_preference_forms():
    lib_attn.configure(preference=["sage", "sdpa"])
    pref = lib_attn.config().preference
    assert pref["unet"] == pref["dit"] == pref["text"] == ("sage", "sdpa")
    assert pref["vae"] == ("sdpa",)  # a list for every role never sends the VAE to sage
    lib_attn.configure(preference={"vae": ["sage"], "unet": "auto"})
    assert lib_attn.config().preference == {"unet": None, "dit": None, "vae": ("sage",), "text": None}
    lib_attn.configure(preference="flash-attn,sdpa-flash")
    assert lib_attn.config().preference["unet"] == ("flash-attn", "sdpa-flash")
    with pytest.raises(ValueError, match="valid ids"):
        lib_attn.configure(preference=["fa2"])
    with pytest.raises(ValueError, match="valid roles"):
        lib_attn.configure(preference={"clip": ["sdpa"]})
    with pytest.raises(ValueError):
        lib_attn.configure(fp32="fp16")


def test_configuration_change_applies_to_the_next_call():
    q, k, v = qkv()
    assert lib_attn.explain(q, k, v).backend == "sdpa"
    lib_attn.attention(q, k, v)
    lib_attn.configure(preference=["math"])
    assert lib_attn.explain(q, k, v).backend == "math"
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
    assert rec.calls == {("unet", "math"): 1}


def test_explain_lists_every_backend_ahead_with_reasons():
    q, k, v = qkv()
    d = lib_attn.explain(q, k, v, backend="sage")
    assert d.backend == "sdpa"
    ids = [bid for bid, _ in d.rejected]
    assert ids[0] == "sage" and "sdpa" not in ids
    assert all(reasons for _, reasons in d.rejected)


def test_backends_listing():
    listed = {b.id: b for b in lib_attn.backends()}
    assert tuple(listed) == lib_attn.BACKEND_IDS
    assert listed["math"].available and listed["sdpa"].available
    assert listed["sdpa"].version.startswith("torch ")
    for b in listed.values():
        assert b.label and (b.available or b.reason)


# --- counters, fallback, strict ---------------------------------------------------------------------

def test_recording_counts_per_role_and_backend():
    q, k, v = qkv()
    with lib_attn.recording() as rec:
        for _ in range(3):
            lib_attn.attention(q, k, v)
        lib_attn.attention(q, k, v, role="vae")
        lib_attn.attention(q, k, v, backend="math", role="dit")
    assert rec.calls == {("unet", "sdpa"): 3, ("vae", "sdpa"): 1, ("dit", "math"): 1}
    assert rec.total() == 5 and rec.total("unet") == 3
    assert set(rec.kernels) == {"sdpa", "math"} and rec.kernels["sdpa"].startswith("sdpa torch ")
    assert lib_attn.last_recording() is rec


def test_a_recording_counts_its_own_threads_calls_and_a_process_recording_every_threads():
    import threading
    q, k, v = qkv()
    everywhere = lib_attn.Recording()  # made directly: every thread's calls, for work spread over threads
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
        worker = threading.Thread(target=lambda: [lib_attn.attention(q, k, v) for _ in range(4)])
        worker.start()
        worker.join()
    everywhere.finish()
    assert rec.calls == {("unet", "sdpa"): 1}  # ``recording()``: this thread's calls only
    assert everywhere.calls == {("unet", "sdpa"): 5}


def test_configured_backend_that_cannot_take_a_call_falls_back_and_is_counted(caplog):
    lib_attn.configure(preference=["sdpa-efficient"])  # CUDA only: every CPU call falls back
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        for _ in range(5):
            out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert rec.calls == {("unet", "sdpa"): 5}
    ((key, count),) = rec.fallbacks.items()
    assert count == 5 and key[:2] == ("unet", "sdpa-efficient")
    assert key[2].startswith("not available: no CUDA device")
    assert len([r for r in caplog.records if "sdpa-efficient" in r.getMessage()]) == 1  # reported once


def test_a_fallback_knows_every_backend_passed_over_and_what_ran():
    """A chain of two CUDA-only backends on a CPU: both are passed over, in order, and sdpa (which the
    chain did not name) runs."""
    q, k, v = qkv()
    lib_attn.configure(preference=["sdpa-efficient", "flash-attn"])     # an earlier chain, same first choice
    lib_attn.attention(q, k, v)
    lib_attn.configure(preference=["sdpa-efficient", "sdpa-cudnn"])
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v)
    ((key, count),) = rec.fallbacks.items()
    assert key[:2] == ("unet", "sdpa-efficient") and count == 1
    report = lib_attn.Report.from_recording(rec)
    others, ran = report.path(key)
    assert [bid for bid, _ in others][:1] == ["sdpa-cudnn"] and others[0][1].startswith("not available: ")
    assert {"sdpa-efficient", "flash-attn"}.isdisjoint(bid for bid, _ in others)   # only what this recording met
    assert ran == ["sdpa"] and rec.calls == {("unet", "sdpa"): 1}


def kernel_fails(monkeypatch, kernel):
    """Make the ``sdpa`` backend's kernel call ``kernel`` (which raises) for every new decision."""
    monkeypatch.setattr(REGISTRY["sdpa"], "runner", lambda spec: kernel)


def test_run_time_failure_demotes_reruns_and_reports_once(monkeypatch, caplog):
    calls = []

    def broken(q, k, v, mask, scale):
        calls.append(1)
        raise RuntimeError("no kernel image is available for execution on the device\nmore detail")
    kernel_fails(monkeypatch, broken)
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        for _ in range(4):
            out = lib_attn.attention(q, k, v)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert calls == [1]  # demoted for the signature after its first failure
    reason = "failed at run time: RuntimeError: no kernel image is available for execution on the device"
    assert rec.fallbacks == {("unet", "sdpa", reason): 4}
    assert rec.calls == {("unet", "math"): 4}  # the CPU chain is sdpa, then math
    assert len([r for r in caplog.records if "sdpa" in r.getMessage()]) == 1
    assert lib_attn.explain(q, k, v).reasons_for("sdpa") == [reason]


def test_unrecoverable_errors_are_not_swallowed(monkeypatch):
    def sticky(q, k, v, mask, scale):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    kernel_fails(monkeypatch, sticky)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        lib_attn.attention(*qkv())


def test_out_of_memory_in_the_vae_retries_on_the_bounded_path(monkeypatch):
    def oom(q, k, v, mask, scale):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    kernel_fails(monkeypatch, oom)
    q, k, v = make_qkv(1, 1, 64, 64, 512, torch.float32)
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, role="vae")
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert rec.calls == {("vae", "math"): 1}
    assert rec.fallbacks == {("vae", "sdpa", "out of memory"): 1}
    with pytest.raises(torch.cuda.OutOfMemoryError):
        lib_attn.attention(q, k, v, role="unet")  # the host handles a denoiser OOM, as without us


def test_strict_mode_raises_instead_of_falling_back(monkeypatch):
    q, k, v = qkv()
    with lib_attn.use(preference=["sage"], strict=True):
        with pytest.raises(lib_attn.AttentionFallbackError, match="sage") as err:
            lib_attn.attention(q, k, v)
        assert "not available" in str(err.value)
    lib_attn.attention(q, k, v)  # no longer strict
    kernel_fails(monkeypatch, lambda *a: (_ for _ in ()).throw(RuntimeError("bad")))
    with lib_attn.use(strict=True), pytest.raises(lib_attn.AttentionFallbackError, match="sdpa failed"):
        lib_attn.attention(q, k, v)


def test_fp32_keep_per_call_is_part_of_the_signature():
    q, k, v = qkv()
    assert lib_attn.explain(q, k, v, fp32="keep").backend == "sdpa"
    out = lib_attn.attention(q, k, v, fp32="keep")
    assert out.dtype == torch.float32


# --- import hygiene -------------------------------------------------------------------------------

IMPORT_CHECK = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"modules", "gradio", "backend", "ldm", "sgm", "launch"}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch
def no_cuda(*a, **k):
    raise AssertionError("CUDA was initialised")
torch.cuda._lazy_init = no_cuda
torch.cuda.init = no_cuda
import lib_attn
lib_attn.backends()
lib_attn.attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
assert not torch.cuda.is_initialized()
print("clean import")
"""


def test_import_needs_no_webui_and_leaves_cuda_alone():
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "clean import" in done.stdout


def test_reapplying_the_same_configuration_keeps_decisions(monkeypatch):
    q, k, v = qkv()
    lib_attn.configure(preference=["math"])
    lib_attn.attention(q, k, v)
    monkeypatch.setattr("lib_attn.dispatch.decide", lambda *a, **kw: pytest.fail("decided again"))
    lib_attn.configure(preference=["math"], fp32="cast", strict=False)  # what hosts do every generation
    with lib_attn.use(fp32="cast"):
        lib_attn.attention(q, k, v)
    lib_attn.attention(q, k, v)
