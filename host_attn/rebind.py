"""Routing a function-convention host: put the engine's functions where the host's model code finds
its attention function.

The webuis' Forge and ``ldm_patched`` lines and ComfyUI choose attention functions once, at import,
and their model modules hold them in two ways, each a kind of target here:

* ``Name``: a module global, bound by ``from … import attention_function`` (or ``… as X``) or chosen
  in the host's own attention module; rebinding the global reaches every later call.
* ``Stored``: a block class whose instances store the function when built
  (``self.optimized_attention = …``); reached through ``Patches.patch_stored``.
* ``Held``: a global of a module the webui loaded by path (a script file), not importable by name.

A target is rebound only when it holds one of the host's own attention functions (``accept``): a
value put there by another extension is left alone and named in the log. Undo is exact (the
``Patches`` record). Text encoders are never targets: they stay on the host's attention.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from . import convention, voice
from .patching import Patches


@dataclass(frozen=True)
class Name:
    """``module.attr`` holds an attention function; ``kind`` "heads" is ``(q, k, v, heads, ...)``,
    "exact" the same for calls the host keeps on an exact kernel, "spatial" the VAE's ``(q, k, v)``
    over ``(B, C, H, W)``."""

    module: str
    attr: str
    role: str
    kind: str = "heads"

    def where(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class Stored:
    """Instances of ``module.cls`` store their attention function as ``attr`` when built."""

    module: str
    cls: str
    attr: str
    role: str = "vae"
    kind: str = "spatial"

    def where(self) -> str:
        return f"{self.module}.{self.cls}.{self.attr} (every block)"


@dataclass(frozen=True)
class Held:
    """``module`` holds an attention function as ``attr`` but cannot be imported by name: a webui script
    file, which the webui loads by path (``name``) and keeps in its own table."""

    module: object
    name: str
    attr: str
    role: str = "unet"
    kind: str = "heads"

    def where(self) -> str:
        return f"{self.name}:{self.attr}"


def import_quietly(name: str):
    """The module, or the reason it cannot be imported here; no reason when it or a package it needs
    is not installed (a model family this host line lacks, or Nunchaku's without its package)."""
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError:
        return None, None
    except Exception as exc:  # noqa: BLE001 - any failure means the host cannot run that family either
        return None, f"{type(exc).__name__}: {exc}"


def copies(source, names, prefix: str = "", values=None, modules=None) -> list[tuple[str, object, str]]:
    """(module name, module, attribute) of every loaded module (whose name starts with ``prefix``) that
    holds the ``source`` module's own value of one of ``names`` under that name: the host's chosen
    function, imported by name. ``source`` itself comes first. ``values``: the chosen functions, where
    ``source`` no longer holds them (some of its names are rebound already). ``modules``: (name, module)
    pairs to scan instead of ``sys.modules``."""
    if values is None:
        values = [getattr(source, name) for name in names if hasattr(source, name)]
    chosen = {id(value) for value in values}
    found = [(source.__name__, source, name) for name in names if id(source.__dict__.get(name)) in chosen]
    for module_name, module in list(sys.modules.items() if modules is None else modules):
        namespace = getattr(module, "__dict__", None)
        if module is source or not module_name.startswith(prefix) or not isinstance(namespace, dict):
            continue
        for name in names:
            value = namespace.get(name)  # the namespace itself: no module __getattr__ runs
            if value is not None and id(value) in chosen:
                found.append((module_name, module, name))
    return found


class Router:
    """The engine's functions for one host, and the record of where they were put.

    ``precision`` is the host's precision rule (``convention.PrecisionRule``) or None; ``accept(value)``
    says whether a target's current value is the host's own attention function; ``fp32_rule`` gives
    the per-call fp32 policy when the host asks for fp32 attention (``convention.keep_fp32`` unless
    the host has its own).
    """

    def __init__(self, name: str, precision=None, accept=None, fp32_rule=convention.keep_fp32):
        self.patches = Patches(name)
        self.precision = precision
        self.accept = accept or (lambda value: callable(value))
        self.fp32_rule = fp32_rule
        self._functions: dict = {}
        self.skipped: dict = {}

    def function(self, role: str, kind: str):
        """One engine function per (role, kind), shared by every target of that role."""
        key = (role, kind)
        if key not in self._functions:
            if kind == "spatial":
                self._functions[key] = convention.make_spatial_function(self.precision, self.fp32_rule)
            else:
                self._functions[key] = convention.make_heads_function(role, self.precision, self.fp32_rule,
                                                                      exact=kind == "exact")
        return self._functions[key]

    def route(self, target, wrap=None) -> bool:
        """Put the engine's function at ``target``; False (and the reason in ``skipped``) when it is
        absent here or holds something that is not the host's. ``wrap(function, held)``: what to put
        there instead, made from the engine's function and the host's function it replaces."""
        module, why = (target.module, None) if isinstance(target, Held) else import_quietly(target.module)
        if module is None:
            if why:
                self.skipped[target.where()] = why
            return False
        named = isinstance(target, (Name, Held))
        owner = module if named else getattr(module, target.cls, None)
        if owner is None or (named and not hasattr(owner, target.attr)):
            return False  # this host has no such model family (an older or newer line)
        if named:
            value = getattr(owner, target.attr)
            if self.patches.is_patched(owner, target.attr):
                return True
            if not self.accept(value):
                self.skipped[target.where()] = (f"holds {getattr(value, '__module__', '?')}."
                                               f"{getattr(value, '__qualname__', value)!s}, not the host's")
                return False
            function = self.function(target.role, target.kind)
            self.patches.patch(owner, target.attr, wrap(function, value) if wrap is not None else function)
        elif not self.patches.is_patched(owner, target.attr):
            self.patches.patch_stored(owner, target.attr, self.function(target.role, target.kind))
        return True

    def routing(self, host_name: str, own: str) -> voice.Routing:
        """Routed when every rebinding made at startup is still in place; else what runs (``own``)."""
        if self.patches.active and self.patches.intact():
            return voice.ROUTED
        return voice.Routing(False, f"{host_name}'s own attention ({own})",
                            "this extension's patches are not in place; the startup log says why")

    def undo(self) -> int:
        self.skipped.clear()
        return self.patches.undo()

    def say(self, host_name: str) -> None:
        """One line naming the host and what was routed, and one for what was left alone; said at every
        load of the scripts (startup and each "Reload UI", which undoes the routing and routes again)."""
        targets = self.patches.targets()
        if targets:
            voice.log(f"{host_name}: attention routed through lib_attn: {', '.join(targets)}")
        else:
            voice.log(f"{host_name}: no attention function found to route; attention is left as the host set it")
        if self.skipped:
            left = "; ".join(f"{where} ({why})" for where, why in self.skipped.items())
            voice.log(f"{host_name}: left on the host's own attention: {left}")
