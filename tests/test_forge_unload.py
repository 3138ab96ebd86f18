"""Forge and Forge Neo after this extension is unloaded ("Reload UI", or the extension turned off in the
Extensions tab, whose "Apply and restart UI" unloads every script): a module that bound
``backend.attention.attention_function`` by name while it was routed (an extension's module imported after
this one: ``from backend.attention import attention_function``) holds the ``StandIn``, which no record of the
routing can put back. Once undone, the stand-in passes every call to the host's function: nothing runs on
this extension after it is gone.
"""
import importlib
import sys

import pytest
import torch

import lib_attn
from tests.doubles.fixtures import webui_factory  # noqa: F401
from tests.test_forge import COPYING_EXTENSION
from webui_attn.routing import forge


@pytest.mark.parametrize("mode", ["forge", "neo"])
def test_a_copy_bound_while_routed_runs_the_hosts_function_once_unloaded(webui_factory, tmp_path, monkeypatch, mode):
    (tmp_path / "copies_while_routed.py").write_text(COPYING_EXTENSION)
    monkeypatch.syspath_prepend(str(tmp_path))
    webui = webui_factory(mode, argv=["--attention-pytorch"])
    webui.load_scripts()
    import backend.attention as attention
    late = importlib.import_module("copies_while_routed")
    try:
        q = torch.randn(1, 8, 32)
        with lib_attn.recording() as rec:
            routed = late.call(q, 2)
        assert rec.calls == {("unet", "sdpa"): 2}
        from modules import script_callbacks
        script_callbacks.script_unloaded_callback()   # Reload UI / the extension turned off
        assert attention.attention_function is attention.attention_pytorch
        with lib_attn.recording() as rec:
            after = late.call(q, 2)
        assert rec.calls == {}
        for a, b in zip(after, routed):
            torch.testing.assert_close(a, b)
        # "Reload UI" with the extension on: routed again, and the old stand-in still passes to the host
        webui.load_scripts()
        assert attention.attention_function is not attention.attention_pytorch
        with lib_attn.recording() as rec:
            late.call(q, 2)
            attention.attention_function(q, q, q, 2)
        assert rec.calls == {("unet", "sdpa"): 1}
    finally:
        sys.modules.pop("copies_while_routed", None)


LDM_COPYING_EXTENSION = (
    "from ldm_patched.ldm.modules.attention import optimized_attention\n"
    "def call(q, heads):\n"
    "    return optimized_attention(q, q, q, heads)\n")


@pytest.mark.parametrize("mode", ["reforge", "classic"])
def test_a_copy_of_optimized_attention_bound_while_routed_runs_the_hosts_once_unloaded(webui_factory, tmp_path,
                                                                                      monkeypatch, mode):
    """reForge and Forge Classic: the same for ``ldm_patched``'s ``optimized_attention``."""
    (tmp_path / "ldm_copies_while_routed.py").write_text(LDM_COPYING_EXTENSION)
    monkeypatch.syspath_prepend(str(tmp_path))
    webui = webui_factory(mode, argv=["--attention-pytorch"])
    import ldm_patched.ldm.modules.attention as attention
    chosen = attention.optimized_attention
    webui.load_scripts()
    late = importlib.import_module("ldm_copies_while_routed")
    try:
        assert late.optimized_attention == chosen   # equal to the host's choice, as on Forge
        q = torch.randn(1, 8, 32)
        with lib_attn.recording() as rec:
            routed = late.call(q, 2)
        assert sum(rec.calls.values()) == 1
        from modules import script_callbacks
        script_callbacks.script_unloaded_callback()
        assert attention.optimized_attention is chosen
        with lib_attn.recording() as rec:
            after = late.call(q, 2)
        assert not rec.calls
        torch.testing.assert_close(after, routed)
    finally:
        sys.modules.pop("ldm_copies_while_routed", None)
