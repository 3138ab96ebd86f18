"""Forge adapter: rebind the attention functions that Forge's model modules imported by name.

Forge picks its attention once at import and ``backend.nn.unet``/``flux``/``chroma`` hold their own
``attention_function`` binding, ``backend.nn.vae`` its ``attention_function_single_head_spatial``; those
bindings are what gets replaced. ``backend.attention.attention_function`` stays as it is, because
``KModel.memory_required`` compares it by identity and would otherwise estimate more memory; T5 keeps
``attention_pytorch``, which its relative-position mask needs.
"""
from __future__ import annotations

import importlib

from . import flags, forwards, host
from .patching import Patches

#: (module, attribute, engine role) rebound with the multi-head function.
HEADS_TARGETS = (
    ("backend.nn.unet", "attention_function", "unet"),
    ("backend.nn.flux", "attention_function", "dit"),
    ("backend.nn.chroma", "attention_function", "dit"),
)
VAE_TARGET = ("backend.nn.vae", "attention_function_single_head_spatial")

patches = Patches("forge")


def attn_precision(requested):
    """Forge's precision rule: ``--disable-attention-upcast`` -> None, ``--force-upcast-attention`` -> fp32,
    else what the caller asked for. Forge's own ``get_attn_precision`` is used when it exists."""
    attention = importlib.import_module("backend.attention")
    resolve = getattr(attention, "get_attn_precision", None)
    return resolve(requested) if resolve is not None else requested


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        host.log_once(("forge-import", name), f"{name} not patched: {e}")
        return None


def install() -> list[str]:
    """Rebind every target that exists; returns what is patched. Harmless when already patched."""
    if patches.active:
        return patches.targets()
    for name, attr, role in HEADS_TARGETS:
        module = _module(name)
        if module is not None and hasattr(module, attr):
            patches.patch(module, attr, forwards.make_heads_function(role, attn_precision))
    name, attr = VAE_TARGET
    module = _module(name)
    if module is not None and hasattr(module, attr):
        patches.patch(module, attr, forwards.make_spatial_function(attn_precision))
    return patches.targets()


def routing() -> host.Routing:
    """Whether attention runs through the engine: every rebinding made at startup is still in place."""
    if patches.active and patches.intact():
        return host.ROUTED
    return host.Routing(False, "Forge's own attention (backend.attention)",
                        "this extension's patches are not in place; the startup log says why")


def uninstall() -> int:
    """Put every original back; safe to call again."""
    return patches.undo()


def apply() -> list[str]:
    """Flags from ``shared.cmd_opts`` into the engine, then the patches; safe to call twice."""
    from modules import shared

    flags.apply(shared.cmd_opts)
    return install()


def register(script_callbacks) -> None:
    """Called at entry-script import: patch now (Forge has no optimizer hook), undo on unload."""
    targets = apply()
    from modules import shared
    flags.say_startup(shared.cmd_opts)
    host.log_once(("forge-patched", tuple(targets)), f"attention routed through lib_attn: {', '.join(targets)}")
    script_callbacks.on_script_unloaded(uninstall)
