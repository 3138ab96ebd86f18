"""The ``ldm_patched`` line: reForge and Forge Classic (ComfyUI's older layout inside a webui).

The host chooses ``optimized_attention`` (and ``optimized_attention_masked``) once, in
``ldm_patched/ldm/modules/attention.py``; its own ``CrossAttention`` (SD1.5, SD2, SDXL) reads them as
module globals, and every other model module (Flux, SD3, Wan, HunyuanVideo, Lumina, …) imports
them by name. So the two globals are rebound, and so is every by-name copy in a loaded module (or a
script file the webui loaded): a module attribute of one of these two names that *is* the host's
chosen function. Modules imported
later bind the rebound globals themselves. The VAE's blocks store the function ``vae_attention()``
chose when built: the image VAE's ``AttnBlock``, and reForge's Wan VAE ``AttentionBlock`` and Cosmos
tokenizer ``CausalAttnBlock`` (``VAE_BLOCKS``).

Text encoders ask ``optimized_attention_for_device`` for a function per call and keep the host's.
reForge's precision rule ``get_attn_precision(requested, dtype)`` is honoured; Forge Classic's
functions take no precision (its SDPA and xformers paths run in the inputs' dtype, as here).
"""
from __future__ import annotations

import sys

from host_attn.convention import PrecisionRule
from host_attn.rebind import Name, Router, Stored, copies

from ..settings import flags
from . import detect
from .forge import StandIn
from .line import Line, script_copies

SOURCE = "ldm_patched.ldm.modules.attention"
NAMES = ("optimized_attention", "optimized_attention_masked")
#: Blocks that store the VAE function when built (the video ones reForge only).
VAE_BLOCKS = (
    Stored("ldm_patched.ldm.modules.diffusionmodules.model", "AttnBlock", "optimized_attention"),
    Stored("ldm_patched.ldm.wan.vae", "AttentionBlock", "optimized_attention"),
    Stored("ldm_patched.ldm.cosmos.cosmos_tokenizer.layers3d", "CausalAttnBlock", "optimized_attention"),
)


def role_of(module_name: str) -> str:
    """A model family's module under ``ldm_patched.ldm`` serves a DiT (a VAE where its path says so);
    the host's own attention module and everything outside (ControlNet's UNet copy, self-attention
    guidance, IP-Adapter) serve the UNet."""
    if module_name.startswith("ldm_patched.ldm.") and module_name != SOURCE:
        return "vae" if ".vae" in module_name else "dit"
    return "unet"


def _chosen(attention) -> set:
    return {id(getattr(attention, name)) for name in NAMES if hasattr(attention, name)}


def by_name_copies(attention) -> list[Name]:
    """Every loaded module's ``optimized_attention``/``optimized_attention_masked`` that is the host's
    chosen function (the source module's own two globals first)."""
    return [Name(module_name, name, role_of(module_name)) for module_name, _, name in copies(attention, NAMES)]


def running() -> detect.Host:
    return detect.ldm_line(sys.modules.get(SOURCE))


def _router(attention) -> Router:
    chosen = _chosen(attention)
    rule = getattr(attention, "get_attn_precision", None)
    return Router("ldm_patched", PrecisionRule(rule, running().name) if rule else None,
                  accept=lambda value: id(value) in chosen, fp32_rule=flags.fp32_for_upcast)


def _route(router: Router, attention) -> None:
    values = [getattr(attention, name) for name in NAMES if hasattr(attention, name)]
    for target in (*by_name_copies(attention), *script_copies(attention, NAMES, values)):
        # the source's own names hold a stand-in: modules that copy them by name while routed (extensions
        # imported later) get the host's function back through it once the routing is undone
        router.route(target, wrap=StandIn if getattr(target, "module", None) == SOURCE else None)
    for target in VAE_BLOCKS:
        router.route(target)


line = Line(SOURCE, running, _router, _route)
install, routing, uninstall, apply, register = line.install, line.routing, line.uninstall, line.apply, line.register
