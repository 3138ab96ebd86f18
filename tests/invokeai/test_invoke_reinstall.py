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


def _scheduled_with_report(seed):
    """txt2img with an unconnected Attention backend node holding a schedule, and a report node after l2i."""
    from invokeai.app.services.shared.graph import Edge, EdgeConnection

    adapter = InvocationRegistry.get_invocation_typeadapter()
    graph = txt2img_graph(seed=seed)
    graph.add_node(adapter.validate_python({"type": "flash_attention_backend", "id": "attn", "use_cache": False,
                                            "schedule": "0-50%: sdpa; 50-100%: sdpa-math"}))
    graph.add_node(adapter.validate_python({"type": "flash_attention_report", "id": "report", "use_cache": False}))
    graph.add_edge(Edge(source=EdgeConnection(node_id="l2i", field="image"),
                        destination=EdgeConnection(node_id="report", field="image")))
    return graph


def test_reload_after_a_git_pull_runs_the_whole_new_pack(host, tmp_path, process, capsys):
    """``git pull`` in the pack's folder, then the Custom Node Manager's Reload (``load_custom_nodes`` again:
    every pack's ``__init__.py`` runs, and the pack's modules stay in ``sys.modules``): the nodes' module is
    defined again on the new packages, and a schedule and the report work on the new code."""
    from invokeai.app.invocations.load_custom_nodes import load_custom_nodes

    nodes = tmp_path / "nodes"
    nodes.mkdir()
    _copy(nodes / "packA")
    assert load_custom_nodes(nodes, logging.getLogger("InvokeAI")) == ["packA"]
    first = host.run_graph(_scheduled_with_report(41))
    assert first.status == "completed", first.error_traceback
    old_nodes = sys.modules["packA.attention_nodes"]
    with open(nodes / "packA" / "lib_attn" / "_version.py", "a", encoding="utf-8") as f:
        f.write("__version__ = '99.0.0'\n")  # what the pull changed
    capsys.readouterr()
    assert load_custom_nodes(nodes, logging.getLogger("InvokeAI")) == ["packA"]
    assert "replaces the code loaded from" in capsys.readouterr().out
    new_nodes = sys.modules["packA.attention_nodes"]
    assert new_nodes is not old_nodes and new_nodes.sessions is sys.modules["invoke_attn.sessions"]
    assert sys.modules["lib_attn"].__version__ == "99.0.0"
    registered = InvocationRegistry.get_invocations_map()
    assert registered["flash_attention_backend"] is new_nodes.AttentionBackendInvocation
    assert registered["flash_attention_report"] is new_nodes.AttentionReportInvocation
    item = host.run_graph(_scheduled_with_report(42))
    assert item.status == "completed", item.error_traceback
    session = sys.modules["invoke_attn.sessions"]._sessions[item.session_id]
    assert set(session.recording.calls) == {("unet", "sdpa"), ("unet", "sdpa-math"), ("vae", "sdpa")}
    report = host.output(item, "report").report
    assert report.startswith("UNet: ") and "sdpa-math" in report


def test_reload_without_a_change_keeps_the_pack_as_it_is(host, tmp_path, process):
    from invokeai.app.invocations.load_custom_nodes import load_custom_nodes

    nodes = tmp_path / "nodes"
    nodes.mkdir()
    _copy(nodes / "packA")
    load_custom_nodes(nodes, logging.getLogger("InvokeAI"))
    engine, node_module = sys.modules["lib_attn"], sys.modules["packA.attention_nodes"]
    load_custom_nodes(nodes, logging.getLogger("InvokeAI"))
    assert sys.modules["lib_attn"] is engine and sys.modules["packA.attention_nodes"] is node_module
    item = host.run_graph(_scheduled_with_report(43))
    assert item.status == "completed", item.error_traceback
    assert "sdpa-math" in host.output(item, "report").report


@pytest.fixture
def other_pack():
    """Another node pack's wrapper of ``invoke_internal``, put on after this pack's hook (as a pack loaded
    later does); counts the nodes it sees. InvokeAI's own method is put back after the test."""
    real = BaseInvocation.__dict__["invoke_internal"]
    while hasattr(real, "__wrapped__"):
        real = real.__wrapped__
    seen = []

    def install():
        below = BaseInvocation.invoke_internal

        def invoke_internal(self, context, services):
            seen.append(self.get_type())
            return below(self, context, services)

        BaseInvocation.invoke_internal = invoke_internal
        return invoke_internal

    yield install, seen
    BaseInvocation.invoke_internal = real


@pytest.mark.parametrize("how", ["uninstall", "update"])
def test_another_packs_wrapper_put_on_after_this_one_keeps_working(host, tmp_path, process, other_pack, how,
                                                                     capsys):
    install_other, seen = other_pack
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    assert _install_pack(_copy(tmp_path / "source"), "packA", nodes / "packA", "system")[0]
    theirs = install_other()
    assert _routed_calls(host) and "l2i" in seen
    assert _uninstall_pack("packA", nodes / "packA")[0]
    if how == "update":
        assert _install_pack(_copy(tmp_path / "new", version="99.0.0"), "packA", nodes / "packA", "system")[0]
    seen.clear()
    item = host.run_graph(txt2img_graph(seed=33))
    assert item.status == "completed", item.error_traceback
    assert "denoise_latents" in seen and "l2i" in seen  # the other pack still sees every node
    said = capsys.readouterr().out
    assert "wrapped again after this extension" in said
    if how == "uninstall":
        assert BaseInvocation.invoke_internal is theirs
        assert sys.modules["invoke_attn.targets"].routed() == []
    else:  # the new hook on top of theirs, and both work
        assert BaseInvocation.invoke_internal.__globals__["__name__"] == "invoke_attn.hook"
        seen.clear()
        assert set(_routed_calls(host)) == {("unet", "sdpa-math"), ("vae", "sdpa")}
        assert "l2i" in seen
        sys.modules["invoke_attn.hook"].remove()
        assert BaseInvocation.invoke_internal is theirs


def test_a_pull_that_cannot_load_leaves_nothing_half_and_says_to_restart(host, tmp_path, process, capsys):
    from invokeai.app.invocations.load_custom_nodes import load_custom_nodes

    real = BaseInvocation.__dict__["invoke_internal"]
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    _copy(nodes / "packA")
    load_custom_nodes(nodes, logging.getLogger("InvokeAI"))
    assert _routed_calls(host)
    broken = nodes / "packA" / "invoke_attn" / "nodes.py"
    good = broken.read_text(encoding="utf-8")
    broken.write_text(good + "\nraise RuntimeError('half-written file')\n", encoding="utf-8")
    capsys.readouterr()
    assert load_custom_nodes(nodes, logging.getLogger("InvokeAI")) == []  # InvokeAI logs the pack's failure
    said = capsys.readouterr().out
    assert "failed to load (RuntimeError: half-written file)" in said and "restart InvokeAI" in said
    types = InvocationRegistry.get_invocations_map()
    assert "flash_attention_backend" not in types and "flash_attention_report" not in types
    assert BaseInvocation.__dict__["invoke_internal"] is getattr(real, "__wrapped__", real)  # no hook of either copy
    assert not any(n.split(".")[0] in PACKAGES and n != "lib_attn.graph_op" for n in sys.modules)
    plain = host.run_graph(txt2img_graph(seed=34))
    assert plain.status == "completed", plain.error_traceback
    broken.write_text(good, encoding="utf-8")  # fixed: the next Reload loads it whole
    assert load_custom_nodes(nodes, logging.getLogger("InvokeAI")) == ["packA"]
    assert set(_routed_calls(host)) == {("unet", "sdpa-math"), ("vae", "sdpa")}
