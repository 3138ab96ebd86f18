"""What happens when InvokeAI loads the pack: the nodes defined under the pack's name, the node hook,
the environment's defaults (said in the log, and a bad value said there without stopping InvokeAI).
The stand-ins go into the models' modules only when a session first routes a node."""
from __future__ import annotations

import importlib.util
import os
import sys

from host_attn import voice

from . import choices, hook, sessions, source

NODES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nodes.py")


def load_nodes(pack: str):
    """``nodes.py`` as the module ``<pack>.attention_nodes``: InvokeAI takes a node's pack from its
    class's module, and lists and removes the pack's nodes by that name."""
    name = f"{pack}.{source.NODES_MODULE}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, NODES_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def start(pack: str, environ=os.environ):
    """Define the nodes, hook InvokeAI, read the defaults; returns the nodes' module."""
    nodes = load_nodes(pack)
    hook.install(nodes.BACKEND_TYPE, nodes.__name__)
    try:
        sessions.default_choice[0] = choices.from_environment(environ)
    except ValueError as exc:
        sessions.default_choice[0] = None
        voice.log(f"InvokeAI: {exc}; sessions are routed only by the Attention backend node")
    try:
        rules = choices.default_schedule(environ)
    except ValueError as exc:
        rules = None
        voice.log(f"InvokeAI: {exc}; no default schedule")
    try:
        sparse = choices.default_sparse(environ)
    except ValueError as exc:
        sparse = None
        voice.log(f"InvokeAI: {exc}; no default sparse attention")
    default = sessions.default_choice[0]
    said = (f"every session's attention runs on this extension's engine ({default.said_by})" if default else
            "add the Attention backend node to a workflow to route its attention")
    voice.log(f"InvokeAI: nodes Attention backend and Attention report loaded; {said}"
              + (f"; default schedule {rules.text!r}" if rules is not None else "")
              + (f"; default sparse attention {sparse.text!r}" if sparse is not None else ""))
    return nodes
