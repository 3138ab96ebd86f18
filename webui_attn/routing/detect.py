"""Which webui is running, recognised by what it has, never by a folder name.

* A1111: ``modules.sd_hijack_optimizations.SdOptimization`` (Forge and its lines removed it).
* The ``backend`` line: ``backend.attention`` and ``backend.nn``. Forge (2024-25) has functions of
  the form ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False)``; Forge Neo has
  ComfyUI's form, with ``skip_output_reshape`` and ``**kwargs``.
* The ``ldm_patched`` line: ``ldm_patched.ldm.modules.attention`` with ``optimized_attention``.
  reForge's functions take ``attn_precision`` (ComfyUI's form without ``**kwargs``); Forge Classic's
  only ``(q, k, v, heads, mask=None)``.

Nothing is imported that the running host has not imported already, except the host's own
attention module, which every one of them imports before it loads extension scripts.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from host_attn import voice
from host_attn.convention import parameters


@dataclass(frozen=True)
class Host:
    """``key``: a1111, forge, neo, reforge, classic or none; ``name``: as the host calls itself;
    ``adapter``: the ``webui_attn.routing`` module that routes its attention ("" for none)."""

    key: str
    name: str
    adapter: str


A1111 = Host("a1111", "A1111", "a1111")
FORGE = Host("forge", "Forge", "forge")
NEO = Host("neo", "Forge Neo", "forge")
REFORGE = Host("reforge", "reForge", "ldm_patched")
CLASSIC = Host("classic", "Forge Classic", "ldm_patched")
NONE = Host("none", "an unrecognised webui", "")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # find_spec imports the parents; a missing or broken parent package means "not this host"
        return False


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a host module that fails to import is not this host's
        return None


def takes_comfy_form(fn) -> bool:
    """Whether an attention function has ComfyUI's form: ``skip_output_reshape``, or ``**kwargs``."""
    params = parameters(fn)
    return "skip_output_reshape" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def backend_line(attention) -> Host:
    """Forge or Forge Neo, from the form of their ``backend.attention``'s functions."""
    return NEO if takes_comfy_form(getattr(attention, "attention_pytorch", None)) else FORGE


def ldm_line(attention) -> Host:
    """reForge or Forge Classic, from whether their ``ldm_patched`` attention functions take a precision."""
    return REFORGE if "attn_precision" in parameters(getattr(attention, "attention_pytorch", None)) else CLASSIC


def detect() -> Host:
    """The host this process runs in."""
    if not _importable("modules"):
        return NONE
    if _importable("backend.attention") and _importable("backend.nn"):
        attention = _import("backend.attention")
        if attention is not None:
            return backend_line(attention)
    if _importable("ldm_patched.ldm.modules.attention"):
        attention = _import("ldm_patched.ldm.modules.attention")
        if attention is not None and hasattr(attention, "optimized_attention"):
            return ldm_line(attention)
    module = _import("modules.sd_hijack_optimizations")
    return A1111 if module is not None and hasattr(module, "SdOptimization") else NONE


def adapter(host: Host | None = None):
    """The adapter module of ``host`` (the running one when None), or None for an unrecognised host."""
    host = host or detect()
    return importlib.import_module(f"webui_attn.routing.{host.adapter}") if host.adapter else None


UNRECOGNISED = "none of A1111, Forge, Forge Neo, reForge or Forge Classic recognised"


def routing() -> voice.Routing:
    """Whether attention goes through this extension in the running webui, from its adapter."""
    running = detect()
    routes = adapter(running)
    if routes is None:
        return voice.Routing(False, f"the webui's own attention ({running.name}: {UNRECOGNISED})")
    return routes.routing()


def lend_for_generation(opts):
    """Route one generation that asks for the engine through it where the webui's own choice runs
    attention now and the adapter can put its forwards over it (A1111 under "Automatic"); returns the
    generation's token, None when not lent. The adapter's ``end_generation(token)`` takes it back."""
    lend = getattr(adapter(), "lend_for_generation", None)
    return lend(opts) if lend is not None else None
