"""``sdpa`` is PyTorch's SDPA even where a host or extension replaced ``F.scaled_dot_product_attention``
(SD.Next's SDP overrides, "SageAttention as SDPA" patches): the replacement is never run under the name
``sdpa``, it is named where users look (explain, the readout's kernel text, the status route, doctor, the
log), and it runs only as ``sdpa-host``, chosen by name."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

import lib_attn
from lib_attn import _compat
from lib_attn.kernels import REGISTRY, sdpa as sdpa_kernels
from lib_attn.kernels.base import EXACT_ASKED
from tests.doubles.fixtures import webui_factory  # noqa: F401
from tests.engine_helpers import make_qkv

TORCH_OWN = _compat.TORCH_SDPA


@pytest.fixture(autouse=True)
def fresh_engine(monkeypatch):
    monkeypatch.setattr(sdpa_kernels, "_warned", set())
    lib_attn.reset()
    yield
    lib_attn.reset()


class Rounding:
    """A stand-in for an "SDPA replaced by an 8-bit kernel" patch: counts its calls and rounds its output
    to bf16, as a quantised kernel's error would show."""

    def __init__(self):
        self.calls = 0

    def install(self, monkeypatch):
        def sage_as_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
            self.calls += 1
            out = TORCH_OWN(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale)
            return out.to(torch.bfloat16).to(query.dtype)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sage_as_sdpa)
        return sage_as_sdpa


def qkv(grad=False):
    q, k, v = make_qkv(1, 2, 64, 64, 32, torch.float32)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def test_torch_own_function_is_what_torch_ships():
    assert F.scaled_dot_product_attention is TORCH_OWN
    assert sdpa_kernels.replacement() is None
    listed = next(b for b in lib_attn.backends() if b.id == "sdpa-host")
    assert not listed.available
    status = REGISTRY["sdpa-host"].probe()
    assert not status.available and "nothing replaced F.scaled_dot_product_attention" in status.reason


@pytest.mark.parametrize("backend", [None, "sdpa", "sdpa-math"])
def test_sdpa_calls_run_torch_own_function_and_say_what_replaced_it(monkeypatch, caplog, backend):
    patch = Rounding()
    fn = patch.install(monkeypatch)
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="lib_attn"), lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, backend=backend)
        lib_attn.attention(q, k, v, backend=backend)
    assert patch.calls == 0
    torch.testing.assert_close(out, TORCH_OWN(q, k, v), rtol=1e-6, atol=1e-6)
    assert (out - fn(q, k, v)).abs().max() > 0   # the replacement's output differs: it did not run
    ran = lib_attn.explain(q, k, v, backend=backend)
    name = f"{__name__}.Rounding.install.<locals>.sage_as_sdpa"
    assert ran.backend == (backend or "sdpa") and ran.variant == (
        f"PyTorch's own, not {name}")
    assert rec.calls == {("unet", ran.backend): 2}
    assert name in rec.kernels[ran.backend]
    warned = [r.getMessage() for r in caplog.records if "replaced by" in r.getMessage()]
    assert len(warned) == 1 and "sdpa-host" in warned[0]   # once per replacement, with what to do


def test_sdpa_host_runs_the_replacement_under_its_own_name(monkeypatch):
    patch = Rounding()
    fn = patch.install(monkeypatch)
    q, k, v = qkv()
    assert REGISTRY["sdpa-host"].probe().available
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v, backend="sdpa-host")
    assert patch.calls >= 1     # its first call is also checked against the bounded reference
    calls = patch.calls
    lib_attn.attention(q, k, v, backend="sdpa-host")
    assert patch.calls > calls
    assert torch.equal(out, fn(q, k, v))
    assert rec.calls == {("unet", "sdpa-host"): 1}
    assert "sage_as_sdpa" in rec.kernels["sdpa-host"]
    assert REGISTRY["sdpa-host"].approximate


def test_exact_calls_never_reach_the_replacement_unless_the_user_vouches_for_it(monkeypatch):
    patch = Rounding()
    patch.install(monkeypatch)
    q, k, v = qkv()
    dec = lib_attn.explain(q, k, v, backend="sdpa-host", exact=True)
    assert dec.backend != "sdpa-host" and ("sdpa-host", [EXACT_ASKED]) in dec.rejected
    lib_attn.attention(q, k, v, backend="sdpa-host", exact=True)
    assert patch.calls == 0
    monkeypatch.setenv(sdpa_kernels.SDPA_HOST_EXACT, "1")
    lib_attn.reset()
    assert not REGISTRY["sdpa-host"].approximate
    lib_attn.attention(q, k, v, backend="sdpa-host", exact=True)
    assert patch.calls >= 1


def test_sdpa_host_is_not_trusted_with_gradients(monkeypatch):
    patch = Rounding()
    patch.install(monkeypatch)
    q, k, v = qkv(grad=True)
    dec = lib_attn.explain(q, k, v, backend="sdpa-host")
    assert dec.backend == "sdpa" and ("sdpa-host", ["no backward pass (inference only)"]) in dec.rejected
    lib_attn.attention(q, k, v, backend="sdpa-host")   # the first call of a signature (tests/test_gradients.py)
    lib_attn.attention(q, k, v, backend="sdpa-host").sum().backward()
    assert patch.calls == 0 and q.grad is not None


def test_without_a_replacement_sdpa_host_falls_back_with_the_reason():
    q, k, v = qkv()
    dec = lib_attn.explain(q, k, v, backend="sdpa-host")
    assert dec.backend == "sdpa"
    assert any(bid == "sdpa-host" and "nothing replaced" in " ".join(r) for bid, r in dec.rejected)


def test_a_replacement_made_after_the_first_decision_is_found_at_the_next_one(monkeypatch):
    q, k, v = qkv()
    assert lib_attn.explain(q, k, v, backend="sdpa").variant == ""
    patch = Rounding()
    patch.install(monkeypatch)
    lib_attn.reset()      # a webui drops its decisions at every configuration change, per generation
    assert "sage_as_sdpa" in lib_attn.explain(q, k, v, backend="sdpa").variant
    assert lib_attn.explain(q, k, v, backend="sdpa-host").backend == "sdpa-host"


def test_a_wrapper_made_with_functools_wraps_is_named_by_its_own_module():
    @functools.wraps(TORCH_OWN)
    def dynamic_slicing(*args, **kwargs):
        return TORCH_OWN(*args, **kwargs)
    assert dynamic_slicing.__qualname__ == TORCH_OWN.__qualname__     # what wraps copied
    named = sdpa_kernels.callable_name(dynamic_slicing)
    assert named.startswith(f"{__name__}.") and named.endswith("dynamic_slicing")   # the qualified name from 3.11
    assert sdpa_kernels.callable_name(functools.partial(dynamic_slicing, dropout_p=0.0)).startswith(
        f"functools.partial({__name__}.")


def test_status_route_and_doctor_name_the_replacement(monkeypatch):
    from host_attn import status
    from lib_attn.commands import doctor

    assert status.availability()["sdpa_replaced_by"] is None
    assert "replaced by" not in doctor.render(doctor.report())
    Rounding().install(monkeypatch)
    name = status.availability()["sdpa_replaced_by"]
    assert name.endswith("Rounding.install.<locals>.sage_as_sdpa")
    doc = doctor.report()
    assert doc["sdpa_replaced_by"] == name
    text = doctor.render(doc)
    assert f"F.scaled_dot_product_attention is replaced by {name}" in text and "sdpa-host" in text
    host = next(b for b in status.availability()["backends"] if b["id"] == "sdpa-host")
    assert host["available"] and host["version"] == name


# --- in a webui: the generation, its infotext and the status route -------------------------------------------

def test_a_webui_generation_on_sdpa_never_reaches_an_extension_replacement(webui_factory, monkeypatch):
    pytest.importorskip("gradio")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tests.test_generation import AUTO_TITLE, start, txt2img
    from webui_attn.ui import api, readout

    from webui_attn.settings import layers
    from webui_attn.ui import panel
    panel.reset()
    monkeypatch.setattr("host_attn.voice._said", set())
    runner, _, _ = start(webui_factory, optimization=AUTO_TITLE)
    monkeypatch.setattr("webui_attn.settings.layers.reset", layers.reset)
    patch = Rounding()
    fn = patch.install(monkeypatch)            # an extension that replaced SDPA when it loaded
    from modules import script_callbacks
    app = FastAPI()
    script_callbacks.app_started_callback(None, app)
    processed, info = txt2img(runner, ["sdpa"])
    report = readout.last_report()
    assert patch.calls == 0 and report.backends("unet") == [("sdpa", 3)]
    attention = readout.parse_infotext(processed.info)["Attention"]
    assert attention.startswith("sdpa") and "PyTorch's own, not " in attention and "sage_as_sdpa" in attention
    body = TestClient(app).get(api.ROUTE).json()
    assert body["availability"]["sdpa_replaced_by"].endswith("sage_as_sdpa")
    from modules import sd_hijack
    sd_hijack.undo_optimizations()             # undo leaves the host's replacement as it found it
    assert F.scaled_dot_product_attention is fn
    panel.reset()
    layers.reset()


def test_a_replacement_taken_off_mid_run_is_never_counted_as_having_run(monkeypatch):
    # A host puts PyTorch's function back (an extension unloaded, another setting chosen) after
    # sdpa-host was decided: the calls from then on run PyTorch's own, and are counted as sdpa.
    patch = Rounding()
    patch.install(monkeypatch)
    q, k, v = qkv()
    with lib_attn.recording() as rec:
        lib_attn.attention(q, k, v, backend="sdpa-host")
        calls = patch.calls
        monkeypatch.setattr(F, "scaled_dot_product_attention", TORCH_OWN)
        out = lib_attn.attention(q, k, v, backend="sdpa-host")
        lib_attn.attention(q, k, v, backend="sdpa-host")
    assert patch.calls == calls
    assert rec.calls == {("unet", "sdpa-host"): 1, ("unet", "sdpa"): 2}
    assert torch.equal(out, TORCH_OWN(q, k, v))


def test_a_replacement_that_routes_back_to_the_engine_is_passed_over_at_once(monkeypatch):
    # A script's "every SDPA through lib_attn" patch, with sdpa-host chosen: without a stop it comes
    # back to sdpa-host until the recursion limit, each level counted as the replacement.
    seen = []

    def through_the_engine(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        seen.append(1)
        return lib_attn.attention(query, key, value, mask=attn_mask, scale=scale)

    monkeypatch.setattr(F, "scaled_dot_product_attention", through_the_engine)
    lib_attn.configure(preference=["sdpa-host", "sdpa"])  # the calls it routes back meet sdpa-host again
    q, k, v = qkv()
    with lib_attn.recording() as rec:
        out = lib_attn.attention(q, k, v)
        lib_attn.attention(q, k, v)
    assert len(seen) == 1
    assert ("unet", "sdpa-host") not in rec.calls and rec.calls[("unet", "sdpa")] >= 2
    assert any("calls this engine back" in reason for (_, _, reason) in rec.fallbacks)
    assert torch.equal(out, TORCH_OWN(q, k, v))
