"""The ``backend`` line: Forge (2024-25) and Forge Neo.

Both choose their attention once, in ``backend/attention.py``, and their model modules hold it by
name (``TARGETS``): the SD UNet, Flux (Chroma calls Flux's ``attention``), Wan 2.x (as
``optimized_attention``), Qwen-Image, Nunchaku's Qwen and Lumina / Z-Image (these three bind
``attention_pytorch`` or ``attention_xformers`` itself), the VAE
(``attention_function_single_head_spatial``) and Wan's VAE, whose blocks store the function when
built. Forge's SD3 / SD3.5 (``backend.nn.mmditx``) defines its own ``attention(q, k, v, heads,
mask=None)``, plain SDPA, and calls it by name. Neo keeps Qwen-Image, Nunchaku's Qwen and Lumina /
Z-Image on PyTorch's or xformers' exact attention whatever kernel it chose: their calls are routed as
exact (no approximate kernel takes them, as ComfyUI's ``low_precision_attention=False`` calls). Text
encoders (T5 with its relative-position mask, the LLM encoders) keep the host's own attention.

``backend.attention.attention_function`` itself, which the builtin extensions (IP-Adapter, SAG,
StyleAlign, reference-only) and ``AttentionProcessorForge`` look up at call time and modules imported
later bind by name, is rebound to a ``StandIn``: the engine's function, equal to the one the host chose,
so that Forge's ``KModel.memory_required``, which compares it with its own functions, estimates the
same memory as without the extension. Modules loaded before this extension that copied the chosen
function by name (``from backend.attention import attention_function [as optimized_attention]``, as
negpip and the guidance extensions do) are found in ``sys.modules`` and in the script files the webui
has loaded, and rebound too (``copies``, the scan the ``ldm_patched`` line uses).

The host's precision rule is called as the host defines it (Forge: ``get_attn_precision(requested)``;
Neo: ``get_attn_precision(requested, dtype)``, whose 2025-10 form raises on a flag Neo never defines:
then the requested precision is used, and that is said once).
"""
from __future__ import annotations

import sys

from host_attn.convention import PrecisionRule
from host_attn.patching import passthrough
from host_attn.rebind import Name, Router, Stored, copies, import_quietly

from ..settings import flags
from . import detect
from .line import Line, script_copies

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
#: The host's own global; see ``StandIn``.
SOURCE_TARGET = Name(SOURCE, "attention_function", "unet")
#: Model modules whose attention stays the host's: text encoders.
TEXT_ENCODERS = ("backend.nn.t5", "backend.nn.clip", "backend.nn.llm.llama", "backend.nn.llm.qwen_vl")
#: The names under which other modules copy the chosen function: the host's own, and the one the
#: extensions written for both lines use (reForge's name for it).
COPY_NAMES = ("attention_function", "optimized_attention")


class StandIn:
    """The engine's function where the host keeps its chosen one (``backend.attention.attention_function``):
    it runs the engine, and compares equal to the host's function (and hashes alike), so that the
    host's own checks of which function it chose (Forge's memory estimate) read as without the extension.
    Modules that bind it by name while it is in force hold it past the routing's undo, which cannot put
    them back: once undone it passes their calls to the host's function (``passthrough``)."""

    __attn_reads_passthrough__ = True

    def __init__(self, function, chosen):
        self.function = function
        self.chosen = chosen
        self.__name__ = self.__qualname__ = getattr(function, "__name__", "lib_attn_attention")
        self.__module__ = getattr(function, "__module__", __name__)
        self.__wrapped__ = function

    def __call__(self, *args, **kwargs):
        return (passthrough(self) or self.function)(*args, **kwargs)

    def __eq__(self, other):
        return other is self or other is self.chosen or NotImplemented

    def __hash__(self):
        return hash(self.chosen)

    def __repr__(self):
        return f"<lib_attn stand-in for {getattr(self.chosen, '__qualname__', self.chosen)}>"


def by_name_copies(attention, chosen) -> list[Name]:
    """Every loaded module's ``attention_function`` / ``optimized_attention`` that is the host's chosen
    function ``chosen``, but for the host's own attention module and its text encoders, which keep it."""
    keep = {SOURCE, *TEXT_ENCODERS}
    return [Name(module_name, name, "dit" if module_name.startswith("backend.nn.") else "unet")
            for module_name, _, name in copies(attention, COPY_NAMES, values=[chosen]) if module_name not in keep]


def _hosts_function(value) -> bool:
    """The host's own: a function of its ``backend`` package (its attention module's, or one a model
    family defines for itself, as SD3's ``mmditx.attention``); anything else was put there by another
    extension and is left alone."""
    return callable(value) and str(getattr(value, "__module__", None) or "").split(".")[0] == "backend"


def running() -> detect.Host:
    return detect.backend_line(sys.modules.get(SOURCE))


def _router(attention) -> Router:
    rule = PrecisionRule(getattr(attention, "get_attn_precision", None), running().name)
    return Router("forge", rule, accept=_hosts_function, fp32_rule=flags.fp32_for_upcast)


def _route(router: Router, attention) -> None:
    for target in TARGETS:
        router.route(target)
    for name in TEXT_ENCODERS:  # imported first, they keep the host's function by name
        import_quietly(name)
    chosen = attention.attention_function
    if _hosts_function(chosen):
        for target in (*by_name_copies(attention, chosen), *script_copies(attention, COPY_NAMES, [chosen])):
            router.route(target)
    router.route(SOURCE_TARGET, wrap=StandIn)


line = Line(SOURCE, running, _router, _route)
install, routing, uninstall, apply, register = line.install, line.routing, line.uninstall, line.apply, line.register
