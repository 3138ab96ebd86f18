"""The ``backend`` line: Forge (2024-25) and Forge Neo.

Both choose their attention once, in ``backend/attention.py``, and their model modules hold it by
name (``TARGETS``): the SD UNet, Flux (Chroma calls Flux's ``attention``), Wan 2.x (as
``optimized_attention``), Qwen-Image, Nunchaku's Qwen and Lumina / Z-Image (these three bind
``attention_pytorch`` or ``attention_xformers`` itself), the VAE (``attention_function_single_head_spatial``) and Wan's VAE,
whose blocks store the function when built. Forge's SD3 / SD3.5 (``backend.nn.mmditx``) defines its
own ``attention(q, k, v, heads, mask=None)``, plain SDPA, and calls it by name. Neo keeps Qwen-Image,
Nunchaku's Qwen and Lumina / Z-Image on PyTorch's or xformers' exact attention whatever kernel it
chose: their calls are routed as exact (no approximate kernel takes them, as ComfyUI's
``low_precision_attention=False`` calls). Text encoders (T5 with its relative-position
mask, the LLM encoders) keep the host's own attention.

``backend.attention.attention_function`` itself (which the builtin extensions look up at call time)
is rebound only where the host does not compare it by identity: Forge's ``KModel.memory_required``
does, and would otherwise estimate more memory (more offloading, smaller batches).

The host's precision rule is called as the host defines it (Forge: ``get_attn_precision(requested)``;
Neo: ``get_attn_precision(requested, dtype)``, whose 2025-10 form raises on a flag Neo never defines:
then the requested precision is used, and that is said once).
"""
from __future__ import annotations

import sys

from host_attn.convention import PrecisionRule
from host_attn.rebind import Name, Router, Stored, import_quietly

from ..settings import flags
from . import detect
from .line import Line

SOURCE = "backend.attention"

#: Where the host's model code finds its attention function, most common first.
TARGETS = (
    Name("backend.nn.unet", "attention_function", "unet"),
    Name("backend.nn.flux", "attention_function", "dit"),
    Name("backend.nn.chroma", "attention_function", "dit"),
    Name("backend.nn.wan", "optimized_attention", "dit"),
    Name("backend.nn.mmditx", "attention", "dit"),
    Name("backend.nn.qwen", "attention_function", "dit", "exact"),
    Name("backend.nn.lumina", "attention_function", "dit", "exact"),
    Name("backend.nn.svdq", "attention_function", "dit", "exact"),
    Name("backend.nn.vae", "attention_function_single_head_spatial", "vae", "spatial"),
    Stored("backend.nn.wan_vae", "AttentionBlock", "optimized_attention"),
)
#: The host's own global; see ``compares_identity``.
SOURCE_TARGET = Name(SOURCE, "attention_function", "unet")
#: Model modules whose attention stays the host's: text encoders.
TEXT_ENCODERS = ("backend.nn.t5", "backend.nn.clip", "backend.nn.llm.llama", "backend.nn.llm.qwen_vl")


def _hosts_function(value) -> bool:
    """The host's own: a function of its ``backend`` package (its attention module's, or one a model
    family defines for itself, as SD3's ``mmditx.attention``); anything else was put there by another
    extension and is left alone."""
    return callable(value) and str(getattr(value, "__module__", None) or "").split(".")[0] == "backend"


def compares_identity() -> bool:
    """Whether the host's memory estimate compares ``backend.attention.attention_function`` with its
    own functions (Forge 2024-25 does; Forge Neo's estimate asks ``xformers_enabled()`` instead)."""
    k_model, _ = import_quietly("backend.modules.k_model")
    estimate = getattr(getattr(k_model, "KModel", None), "memory_required", None)
    code = getattr(estimate, "__code__", None)
    return code is not None and "attention_function" in code.co_names


def running() -> detect.Host:
    return detect.backend_line(sys.modules.get(SOURCE))


def _router(attention) -> Router:
    rule = PrecisionRule(getattr(attention, "get_attn_precision", None), running().name)
    return Router("forge", rule, accept=_hosts_function, fp32_rule=flags.fp32_for_upcast)


def _route(router: Router, attention) -> None:
    for target in TARGETS:
        router.route(target)
    if not compares_identity():
        for name in TEXT_ENCODERS:  # imported first, they keep the host's function by name
            import_quietly(name)
        router.route(SOURCE_TARGET)


line = Line(SOURCE, running, _router, _route)
install, routing, uninstall, apply, register = line.install, line.routing, line.uninstall, line.apply, line.register
