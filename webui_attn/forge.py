"""The ``backend`` line: Forge (2024-25) and Forge Neo.

Both choose their attention once, in ``backend/attention.py``, and their model modules hold it by
name (``TARGETS``): the SD UNet, Flux (Chroma calls Flux's ``attention``), Wan 2.x (as
``optimized_attention``), Qwen-Image, Nunchaku's Qwen and Lumina / Z-Image (these three bind
``attention_pytorch`` itself), the VAE (``attention_function_single_head_spatial``) and Wan's VAE,
whose blocks store the function when built. Text encoders (T5 with its relative-position mask, the
LLM encoders) keep the host's own attention.

``backend.attention.attention_function`` itself (which the builtin extensions look up at call time)
is rebound only where the host does not compare it by identity: Forge's ``KModel.memory_required``
does, and would otherwise estimate more memory (more offloading, smaller batches).

The host's precision rule is called as the host defines it (Forge: ``get_attn_precision(requested)``;
Neo: ``get_attn_precision(requested, dtype)``, whose 2025-10 form raises on a flag Neo never defines:
then the requested precision is used, and that is said once).
"""
from __future__ import annotations

import sys

from . import flags, heads, host, hosts
from .rebind import Name, Router, Stored, import_quietly

SOURCE = "backend.attention"

#: Where the host's model code finds its attention function, most common first.
TARGETS = (
    Name("backend.nn.unet", "attention_function", "unet"),
    Name("backend.nn.flux", "attention_function", "dit"),
    Name("backend.nn.chroma", "attention_function", "dit"),
    Name("backend.nn.wan", "optimized_attention", "dit"),
    Name("backend.nn.qwen", "attention_function", "dit"),
    Name("backend.nn.lumina", "attention_function", "dit"),
    Name("backend.nn.svdq", "attention_function", "dit"),
    Name("backend.nn.vae", "attention_function_single_head_spatial", "vae", "spatial"),
    Stored("backend.nn.wan_vae", "AttentionBlock", "optimized_attention"),
)
#: The host's own global; see ``compares_identity``.
SOURCE_TARGET = Name(SOURCE, "attention_function", "unet")
#: Model modules whose attention stays the host's: text encoders.
TEXT_ENCODERS = ("backend.nn.t5", "backend.nn.clip", "backend.nn.llm")

router: Router | None = None


def _hosts_function(value) -> bool:
    return callable(value) and getattr(value, "__module__", None) == SOURCE


def compares_identity() -> bool:
    """Whether the host's memory estimate compares ``backend.attention.attention_function`` with its
    own functions (Forge 2024-25 does; Forge Neo's estimate asks ``xformers_enabled()`` instead)."""
    k_model, _ = import_quietly("backend.modules.k_model")
    estimate = getattr(getattr(k_model, "KModel", None), "memory_required", None)
    code = getattr(estimate, "__code__", None)
    return code is not None and "attention_function" in code.co_names


def running() -> hosts.Host:
    attention = sys.modules.get(SOURCE)
    return hosts.NEO if hosts.takes_comfy_form(getattr(attention, "attention_pytorch", None)) else hosts.FORGE


def install() -> list[str]:
    """Rebind every target this host has; returns what is routed. Harmless when already routed."""
    global router
    if router is not None and router.patches.active:
        return router.patches.targets()
    attention, why = import_quietly(SOURCE)
    if attention is None:
        host.log_once(("forge-import", SOURCE), f"{SOURCE} not patched: {why}")
        return []
    router = Router("forge", heads.PrecisionRule(getattr(attention, "get_attn_precision", None), running().name),
                    accept=_hosts_function)
    for target in TARGETS:
        router.route(target)
    if not compares_identity():
        router.route(SOURCE_TARGET)
    return router.patches.targets()


def routing() -> host.Routing:
    """Whether attention runs through the engine: every rebinding made at startup is still in place."""
    if router is None:
        return host.Routing(False, f"{running().name}'s own attention ({SOURCE})",
                            "this extension's patches are not in place; the startup log says why")
    return router.routing(running().name, SOURCE)


def uninstall() -> int:
    """Put every original back; safe to call again."""
    return router.undo() if router is not None else 0


def apply() -> list[str]:
    """The host's own attention flags and this extension's into the engine, then the patches; safe to
    call twice."""
    from modules import shared

    flags.apply_host(running())
    flags.apply(shared.cmd_opts)
    return install()


def register(script_callbacks) -> None:
    """Called at entry-script import: patch now (these hosts have no optimizer hook), undo on unload."""
    apply()
    from modules import shared

    flags.say_startup(shared.cmd_opts)
    if router is not None:
        router.say(running().name)
    script_callbacks.on_script_unloaded(uninstall)
