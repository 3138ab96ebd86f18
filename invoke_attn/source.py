"""Which copy of the pack's code runs: an update through InvokeAI's Custom Node Manager without a restart.

The manager cannot install over a pack: an update is an uninstall (the folder deleted, the pack's nodes
unregistered, the modules named after the pack's folder dropped from ``sys.modules``) and an install (the
new folder cloned and its ``__init__.py`` run), in one process. The project's own packages (``lib_attn``,
``host_attn``, ``invoke_attn``) are not named after the folder, so they outlive the uninstall. When the
root ``__init__.py`` of a copy runs while packages loaded from another folder or from other code are in
``sys.modules`` (``SOURCE``, the digest of the code they were loaded from, differs from this copy's),
``replace_earlier`` takes the earlier copy's hook and stand-ins off, unregisters its nodes and drops its
modules (the nodes' module included), so that this copy's are imported and define the nodes again; the same folder with the same code keeps them (the hook is bound to the nodes'
module again).

One module stays: ``lib_attn.graph_op``, whose operator torch registers once per process under its
name; the new engine hands it its attention as it is imported. Where that file itself changed (or it
is not known what it was loaded from), a model compiled with torch.compile keeps the earlier operator
until InvokeAI restarts, and the log says so.

This file is loaded by path by the root ``__init__.py`` before any package, and by ``invoke_attn`` for
its ``SOURCE``: it imports nothing of the project.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys

PACKAGES = ("lib_attn", "host_attn", "invoke_attn")
#: The nodes' module under the pack's package: ``<pack>.attention_nodes`` (``startup.load_nodes``).
NODES_MODULE = "attention_nodes"
#: Modules kept across a replacement (see above).
KEEP = ("lib_attn.graph_op",)


def _files(root: str):
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, root).replace(os.sep, "/"), path


def fingerprint(root: str, only: str | None = None) -> str:
    """The digest of the packages' Python files under ``root`` (or of the one file ``only``), by content
    and relative path: the same code has the same digest in any folder."""
    digest = hashlib.sha256()
    for relative, path in _files(root):
        if only is None or relative == only:
            with open(path, "rb") as f:
                digest.update(relative.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _take_off(old) -> None:
    """The earlier copy's hook, stand-ins and sessions, through its own modules (any version of them)."""
    for module, function in (("hook", "remove"), ("targets", "undo"), ("sessions", "reset")):
        undo = getattr(sys.modules.get(f"{old.__name__}.{module}"), function, None)
        if undo is not None:
            undo()


def drop_nodes() -> list[str]:
    """Unregister the earlier copy's nodes and drop their module (``<pack>.attention_nodes``, which InvokeAI's
    Reload keeps: it runs the root ``__init__.py`` again without purging the pack's modules), so that this
    copy defines them again on its own packages. Returns the modules dropped."""
    dropped = []
    registry = getattr(sys.modules.get("invokeai.app.invocations.baseinvocation"), "InvocationRegistry", None)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.endswith(f".{NODES_MODULE}") and path.endswith(os.path.join("invoke_attn", "nodes.py")):
            if registry is not None and hasattr(registry, "unregister_pack"):
                registry.unregister_pack(name.split(".")[0])
            del sys.modules[name]
            dropped.append(name)
    return dropped


def replace_earlier(root: str, log=print) -> str | None:
    """Take off and drop the project's packages when they were loaded from another folder (which an
    uninstall deleted: the packages read files beside them) or from other code than this copy's (under
    ``root``); returns the folder they came from, or None when nothing was replaced."""
    old = sys.modules.get("invoke_attn")
    if old is None:
        return None
    came_from = os.path.dirname(os.path.dirname(os.path.abspath(old.__file__ or "")))
    if os.path.realpath(came_from) == os.path.realpath(root) and getattr(old, "SOURCE", None) == fingerprint(root):
        return None
    kept_operator = sys.modules.get(KEEP[0])
    _take_off(old)
    drop_nodes()
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES and n not in KEEP]:
        del sys.modules[name]
    said = f"InvokeAI: this copy of the pack ({root}) replaces the code loaded from {came_from}, without a restart"
    if kept_operator is not None and getattr(kept_operator, "_pack_source", None) != fingerprint(
            root, "lib_attn/graph_op.py"):
        said += ("; its torch.compile operator may differ from the one registered first: a model compiled with "
                 "torch.compile keeps that one until InvokeAI restarts")
    log(f"[flash-attention] {said}")
    return came_from


@contextlib.contextmanager
def replacing(root: str, pack: str, log=print):
    """``replace_earlier``, then the loading of this copy (the body): when it fails after earlier code was
    taken off, what of this copy was loaded is dropped and its nodes unregistered, so that nothing runs half
    on one copy and half on the other, and the log says to restart InvokeAI."""
    came_from = replace_earlier(root, log)
    try:
        yield came_from
    except BaseException as exc:
        if came_from is not None:
            new = sys.modules.get("invoke_attn")
            if new is not None:
                _take_off(new)  # whatever of it was put on before the failure
            registry = getattr(sys.modules.get("invokeai.app.invocations.baseinvocation"), "InvocationRegistry", None)
            if registry is not None and hasattr(registry, "unregister_pack"):
                registry.unregister_pack(pack)
            drop_nodes()
            for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES and n not in KEEP]:
                del sys.modules[name]
            log(f"[flash-attention] InvokeAI: this copy of the pack ({root}) failed to load ({type(exc).__name__}: "
                f"{exc}) after the code loaded from {came_from} was taken off: restart InvokeAI to use the pack "
                f"(until then its nodes are missing and no attention is routed)")
        raise


def record_operator(root: str) -> None:
    """Note what the registered operator's module was loaded from (once: the module is kept)."""
    module = sys.modules.get(KEEP[0])
    if module is not None and not hasattr(module, "_pack_source"):
        here = os.path.dirname(os.path.abspath(module.__file__ or "")) == os.path.join(root, "lib_attn")
        module._pack_source = fingerprint(root, "lib_attn/graph_op.py") if here else None
