"""Install the ComfyUI 0.8.0 double into this process for one test, and load this repository into it as
ComfyUI loads a custom node.

    from tests.doubles.comfy_fixtures import comfy_factory  # noqa: F401

    def test_something(comfy_factory):
        comfy = comfy_factory(argv=["--cpu"], env={"ATTN_COMFY_ROUTE": "auto"})
        comfy.load_node()             # prestartup script, then the package through nodes.load_custom_node
        from comfy.ldm.modules import attention
        ...

In order, as ComfyUI's main.py does: ``sys.argv`` set, argument parsing switched on and
``comfy.cli_args`` imported, each custom node's ``prestartup_script.py`` run, then the ``PromptServer``
made, and ``load_node`` imports the package from ``custom_nodes/sd-webui-flash-attention`` (a link to
this repository). On exit: the package's routing undone, every double module dropped, ``sys.path``,
``sys.argv`` and the environment restored. One double at a time (not together with a webui double).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
COMFY_ROOT = os.path.join(HERE, "comfy")
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
NODE_NAME = "sd-webui-flash-attention"
DOUBLE_MODULES = ("comfy", "comfy_execution", "server", "nodes", "execution", "nodes_sag")
ENV = ("ATTN_COMFY_ROUTE", "ATTN_COMFY_SCHEDULE", "ATTN_CLAIMED_FLAGS")


class Comfy:
    def __init__(self, custom_nodes: str):
        self.custom_nodes = custom_nodes
        self.node_dir = os.path.join(custom_nodes, NODE_NAME)

    def prestartup(self) -> None:
        """What main.py does for every custom node before importing ComfyUI's modules."""
        script = os.path.join(self.node_dir, "prestartup_script.py")
        spec = importlib.util.spec_from_file_location("prestartup_script", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

    def load_node(self) -> bool:
        import nodes
        return asyncio.run(nodes.load_custom_node(self.node_dir))

    @property
    def server(self):
        from server import PromptServer
        return PromptServer.instance


def _drop():
    roots = (tempfile.gettempdir().replace(".", "_x_"), tempfile.gettempdir(), COMFY_ROOT, os.path.realpath(COMFY_ROOT))
    for name in list(sys.modules):
        if name.split(".")[0] in DOUBLE_MODULES or name.startswith(roots):   # files ComfyUI names by path too
            del sys.modules[name]


@contextlib.contextmanager
def comfy_double(argv=(), env=None, prestartup=True, root=COMFY_ROOT):
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    saved_env = {k: os.environ.get(k) for k in ENV}
    tmp = tempfile.TemporaryDirectory()
    custom_nodes = os.path.join(tmp.name, "custom_nodes")
    os.makedirs(custom_nodes)
    os.symlink(REPO_ROOT, os.path.join(custom_nodes, NODE_NAME))
    _drop()
    try:
        for key in ENV:
            os.environ.pop(key, None)
        os.environ.update(env or {})
        sys.path.insert(0, root)
        sys.argv = ["main.py", *argv]
        import comfy.options
        comfy.options.enable_args_parsing()
        import comfy.cli_args  # noqa: F401
        comfy = Comfy(custom_nodes)
        if prestartup:
            comfy.prestartup()
        import server
        server.PromptServer()
        yield comfy
    finally:
        try:
            route = sys.modules.get("comfy_attn.route")
            if route is not None:
                route.undo()
            run = sys.modules.get("comfy_attn.run")
            if run is not None:
                run.reset()
            lib_attn = sys.modules.get("lib_attn")
            if lib_attn is not None:
                lib_attn.reset()
        finally:
            _drop()
            sys.path[:] = saved_path
            sys.argv[:] = saved_argv
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            tmp.cleanup()


@pytest.fixture
def comfy_factory():
    """``comfy_factory(argv=(), env=None, prestartup=True, root=COMFY_ROOT)`` -> Comfy (``root``: where
    ComfyUI is found, a symbolic link to the double for instance); uninstalled after the test."""
    stack = contextlib.ExitStack()

    def make(argv=(), env=None, prestartup=True, root=COMFY_ROOT):
        return stack.enter_context(comfy_double(argv, env, prestartup, root))

    with stack:
        yield make
