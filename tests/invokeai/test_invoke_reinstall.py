"""An update through InvokeAI's Custom Node Manager, in one process: uninstall (the folder deleted, the
pack's nodes unregistered, its modules purged) and install (the folder put back and loaded), with the
manager's own steps (the double of ``invokeai/app/api/routers/custom_nodes.py``). The new copy's code must
run from the next session on, under the same folder name or another, without a restart."""
import logging
import os
import shutil
import sys

import pytest

from invokeai.app.api.routers.custom_nodes import _install_pack, _uninstall_pack
from invokeai.app.invocations.baseinvocation import BaseInvocation, InvocationRegistry
from invokeai_host import txt2img_graph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("lib_attn", "host_attn", "invoke_attn")


def _copy(target, version=None):
    """The pack's code as a clone of it holds it; ``version``: an update's engine version."""
    ignore = shutil.ignore_patterns("__pycache__")
    os.makedirs(target)
    shutil.copy(os.path.join(ROOT, "__init__.py"), target)
    for package in (*PACKAGES, "comfy_attn"):
        shutil.copytree(os.path.join(ROOT, package), os.path.join(target, package), ignore=ignore)
    if version:
        with open(os.path.join(target, "lib_attn", "_version.py"), "a", encoding="utf-8") as f:
            f.write(f"__version__ = {version!r}\n")
    return str(target)


@pytest.fixture
def process():
    """This process's packages as they were, put back after the test (whatever copy the test left live)."""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in PACKAGES}
    yield
    for module, undo in (("invoke_attn.hook", "remove"), ("invoke_attn.targets", "undo"),
                         ("invoke_attn.sessions", "reset")):
        getattr(sys.modules[module], undo)()
    for name in [n for n in sys.modules if n.split(".")[0] in (*PACKAGES, "packA", "packB")]:
        del sys.modules[name]
    sys.modules.update(saved)


def _routed_calls(host):
    """Runs a graph with the Attention backend node (sdpa-math; InvokeAI may answer it from its cache) and
    returns the calls the live engine counted."""
    graph = txt2img_graph(seed=31)
    node = InvocationRegistry.get_invocation_typeadapter().validate_python(
        {"type": "flash_attention_backend", "id": "attn", "backend": "sdpa-math"})  # use_cache on, as by default
    graph.add_node(node)
    item = host.run_graph(graph)
    assert item.status == "completed", item.error_traceback
    session = sys.modules["invoke_attn.sessions"]._sessions.get(item.session_id)
    return {} if session is None else dict(session.recording.calls)


@pytest.mark.parametrize("second", ["packA", "packB"], ids=["same-folder", "other-folder"])
def test_the_same_code_reinstalled_routes_again(host, tmp_path, process, second):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    source = _copy(tmp_path / "source")
    assert _install_pack(source, "packA", nodes / "packA", "system")[0]
    assert set(_routed_calls(host)) == {("unet", "sdpa-math"), ("vae", "sdpa")}
    assert _uninstall_pack("packA", nodes / "packA")[0]
    assert _install_pack(source, second, nodes / second, "system")[0]  # no session ran in between
    assert set(_routed_calls(host)) == {("unet", "sdpa-math"), ("vae", "sdpa")}
    assert BaseInvocation.invoke_internal.__globals__["__name__"] == "invoke_attn.hook"


@pytest.mark.parametrize("second", ["packA", "packB"], ids=["same-folder", "other-folder"])
def test_an_update_runs_the_new_code_without_a_restart(host, tmp_path, process, second, capsys):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    assert _install_pack(_copy(tmp_path / "old"), "packA", nodes / "packA", "system")[0]
    old_engine = sys.modules["lib_attn"]
    assert _routed_calls(host)
    assert _uninstall_pack("packA", nodes / "packA")[0]
    capsys.readouterr()
    assert _install_pack(_copy(tmp_path / "new", version="99.0.0"), second, nodes / second, "system")[0]
    said = capsys.readouterr().out
    assert f"this copy of the pack ({nodes / second}) replaces the code loaded from" in said
    engine = sys.modules["lib_attn"]
    assert engine is not old_engine and engine.__version__ == "99.0.0"
    assert os.path.dirname(engine.__file__) == str(nodes / second / "lib_attn")
    assert set(_routed_calls(host)) == {("unet", "sdpa-math"), ("vae", "sdpa")}  # counted by the new copy
    hook = sys.modules["invoke_attn.hook"]
    assert BaseInvocation.invoke_internal.__globals__ is vars(hook)
    assert os.path.dirname(hook.__file__) == str(nodes / second / "invoke_attn")
    # The operator torch registered once stays, running the new engine.
    assert sys.modules["lib_attn.graph_op"]._engine is sys.modules["lib_attn.dispatch"].attention


def test_uninstalled_alone_the_pack_leaves_invokeai_as_it_was(host, tmp_path, process):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    original = BaseInvocation.invoke_internal
    assert _install_pack(_copy(tmp_path / "source"), "packA", nodes / "packA", "system")[0]
    assert _routed_calls(host)
    assert _uninstall_pack("packA", nodes / "packA")[0]
    item = host.run_graph(txt2img_graph(seed=32))
    assert item.status == "completed", item.error_traceback
    assert BaseInvocation.invoke_internal is getattr(original, "__wrapped__", original)
    assert sys.modules["invoke_attn.targets"].routed() == []
