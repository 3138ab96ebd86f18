"""Routing ComfyUI's attention through the engine, from narrowest to widest.

* One model (the Attention backend node): ComfyUI wraps every attention function in ``wrap_attn``,
  which calls ``transformer_options["optimized_attention_override"](func, *args, **kwargs)`` when a
  model's options carry one: every call of that model's forward (SD1.5/SDXL, Flux, SD3, Wan,
  Qwen-Image, Lumina, HunyuanVideo, …) then reaches ``override``. An ``OUTER_SAMPLE`` wrapper puts
  the node's configuration in force while that model samples and counts the run; while a schedule is
  in force it also has the model's blocks tell the engine where they start
  (``lib_attn.schedule.blocks``), and an ``APPLY_MODEL`` wrapper tells it the step of each model
  call (``steps.model_call``).
* One VAE (the VAE attention backend node): VAE blocks store their function when built and no
  wrapper reaches them, so a class descriptor (``Patches.patch_stored``) gives them the engine's
  function while a routed VAE's encode or decode runs; the VAE object ComfyUI caches keeps its own.
* Every model and VAE (the global route, ``ATTN_COMFY_ROUTE`` or ComfyUI's own
  ``--use-flash-attention`` / ``--use-sage-attention`` with this package installed): every loaded
  module's ``optimized_attention`` / ``optimized_attention_masked`` that is ComfyUI's chosen function
  is rebound to the engine's, wrapped in ComfyUI's own ``wrap_attn`` so that overrides still apply,
  and the VAE blocks see the engine's function always. No wrapper reaches every model, so the step
  is followed from the attention calls (a new ``sigmas`` tensor is a new model call), and the blocks
  are not known.

Text encoders ask ``optimized_attention_for_device`` for their function and keep ComfyUI's.
"""
from __future__ import annotations

import contextvars
import importlib
import inspect
import sys

import lib_attn
from lib_attn import schedule

from host_attn import convention, voice
from host_attn.patching import Patches
from host_attn.rebind import copies, import_quietly

from . import run, steps

SOURCE = "comfy.ldm.modules.attention"
NAMES = ("optimized_attention", "optimized_attention_masked")
#: (module, class): VAE blocks that store their attention function as ``optimized_attention`` when built.
VAE_BLOCKS = (
    ("comfy.ldm.modules.diffusionmodules.model", "AttnBlock"),
    ("comfy.ldm.wan.vae", "AttentionBlock"),
    ("comfy.ldm.cosmos.cosmos_tokenizer.layers3d", "CausalAttnBlock"),
    ("comfy.ldm.mmaudio.vae.vae_modules", "AttnBlock1D"),
)
WRAPPER_KEY = "flash_attention"
UNET_CLASS = ("comfy.ldm.modules.diffusionmodules.openaimodel", "UNetModel")

#: The configuration of the routed VAE whose encode/decode runs now (None: ComfyUI's own attention).
_vae_config: contextvars.ContextVar = contextvars.ContextVar("lib_attn_vae_config", default=None)
_blocks = Patches("comfy-vae")
_global = Patches("comfy-global")
_functions: dict = {}
_consults: dict = {}


def precision():
    """ComfyUI's ``get_attn_precision(requested, dtype)``, called as ComfyUI defines it."""
    attention = importlib.import_module(SOURCE)
    return convention.PrecisionRule(getattr(attention, "get_attn_precision", None), "ComfyUI")


def consults_precision(func) -> bool:
    """Whether ComfyUI's attention function ``func`` acts on ``attn_precision``: its basic, split and
    sub-quadratic functions ask ``get_attn_precision`` and upcast; PyTorch's, xformers', flash-attn's
    and SageAttention's run in the inputs' dtype whatever the call asks. A function that cannot be
    read is taken to act on it."""
    try:
        return _consults[func]
    except (KeyError, TypeError):
        pass
    code = getattr(inspect.unwrap(func), "__code__", None)
    found = code is None or "get_attn_precision" in code.co_names
    try:
        _consults[func] = found
    except TypeError:
        pass
    return found


def _no_upcast(requested, dtype):
    return None


def fp32_rule(fp32: str | None):
    """The per-call fp32 policy when ComfyUI asks for fp32 attention: ``keep``, unless the node set one."""
    def rule(upcast: bool):
        return None if not upcast or fp32 else "keep"
    return rule


def function(role: str, fp32: str | None = None, upcasts: bool = True):
    """The engine's attention function for ``role`` (ComfyUI's form; see ``host_attn.convention``).
    ``upcasts``: the ComfyUI function the call stands in for acts on ``attn_precision``
    (``consults_precision``); where it does not, a call asking for fp32 runs in its own dtype as there,
    unless the node's fp32 setting is given (then it runs in fp32 under that setting)."""
    key = (role, fp32, upcasts)
    if key not in _functions:
        if role == "vae":
            _functions[key] = convention.make_spatial_function(precision(), fp32_rule(fp32))
        else:
            rule = precision() if upcasts or fp32 else _no_upcast
            _functions[key] = convention.make_heads_function(role, rule, fp32_rule(fp32))
    return _functions[key]


def role_of(model_patcher) -> str:
    """``unet`` for SD1.5/SD2/SDXL's UNet, ``dit`` for every other denoiser."""
    module, name = UNET_CLASS
    unet = getattr(sys.modules.get(module), name, None)
    diffusion = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    return "unet" if unet is not None and isinstance(diffusion, unet) else "dit"


# --- one model --------------------------------------------------------------------------------------

def make_override(role: str, fp32: str | None = None):
    """``optimized_attention_override``: ComfyUI calls it as ``override(func, *args, **kwargs)`` with
    the arguments of the attention function ``func``; the engine serves the call instead."""
    upcasting, own_dtype = function(role, fp32), function(role, fp32, upcasts=False)

    def override(func, *args, **kwargs):
        return (upcasting if consults_precision(func) else own_dtype)(*args, **kwargs)

    override.__qualname__ = override.__name__ = f"lib_attn_{role}_override"
    return override


def make_sample_wrapper(config: dict):
    """An ``OUTER_SAMPLE`` wrapper: the model samples under ``config``, counted in the run. While a
    schedule is in force, the blocks of the model being sampled (the guider's, ``executor.class_obj``)
    tell the engine where they start; no step is known before or after."""
    def wrapper(executor, *args, **kwargs):
        with run.segment(config):
            if lib_attn.config().schedule is None:
                return executor(*args, **kwargs)
            steps.leave()
            try:
                with schedule.blocks(executor.class_obj.model_patcher.model.diffusion_model):
                    return executor(*args, **kwargs)
            finally:
                steps.leave()
    return wrapper


def model_call_wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={},
                       **kwargs):
    """An ``APPLY_MODEL`` wrapper (called as ``BaseModel.apply_model`` calls it): the engine is told
    the step of this model call, once, before its attention calls."""
    steps.model_call(transformer_options)
    return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


def route_model(model_patcher, config: dict, fp32: str | None = None):
    """A clone of ``model_patcher`` whose attention runs on the engine under ``config``."""
    from comfy.patcher_extension import WrappersMP

    model = model_patcher.clone()
    options = model.model_options.setdefault("transformer_options", {})
    options["optimized_attention_override"] = make_override(role_of(model), fp32)
    for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.APPLY_MODEL):
        model.remove_wrappers_with_key(kind, WRAPPER_KEY)
    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, make_sample_wrapper(config))
    model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, model_call_wrapper)
    return model


# --- VAE blocks ---------------------------------------------------------------------------------------

def _vae_routed() -> bool:
    return _vae_config.get() is not None or _global.active


def route_vae_blocks() -> list[str]:
    """Put the descriptor on every VAE block class that is loaded (once): blocks see the engine's
    function while a routed VAE runs or the global route is on, and their own otherwise."""
    for module_name, cls_name in VAE_BLOCKS:
        module, _ = import_quietly(module_name)
        cls = getattr(module, cls_name, None) if module is not None else None
        if cls is not None and not _blocks.is_patched(cls, "optimized_attention"):
            _blocks.patch_stored(cls, "optimized_attention", _vae_function, when=_vae_routed)
    return _blocks.targets()


def _vae_function(q, k, v):
    config = _vae_config.get()
    return function("vae", (config or {}).get("fp32"))(q, k, v)


VAE_METHODS = ("decode", "decode_tiled", "encode", "encode_tiled")


def route_vae(vae, config: dict):
    """A copy of ComfyUI's ``VAE`` object whose encode/decode run its blocks on the engine under
    ``config``; the original (which ComfyUI caches between graphs) is left as it is."""
    import copy

    route_vae_blocks()
    routed = copy.copy(vae)
    for name in VAE_METHODS:
        method = getattr(vae, name, None)
        if method is not None:
            setattr(routed, name, _in_vae_segment(method, config))
    return routed


def _in_vae_segment(method, config: dict):
    def routed(*args, **kwargs):
        token = _vae_config.set(dict(config))
        try:
            with run.segment(config) as current:
                images = method(*args, **kwargs)
                run.remember(images, current)
                return images
        finally:
            _vae_config.reset(token)
    routed.__name__ = getattr(method, "__name__", "routed")
    return routed


# --- every model: the global route --------------------------------------------------------------------

def route_everything(config: dict | None = None) -> list[str]:
    """Rebind ComfyUI's chosen function wherever a loaded module holds it, and route every VAE
    block; returns what was routed. ``config`` is put in force for good."""
    attention = importlib.import_module(SOURCE)
    if config:
        lib_attn.configure(**config)
    if not _global.active:
        wrap = getattr(attention, "wrap_attn", None)
        upcasts = consults_precision(attention.optimized_attention)
        for _, module, name in copies(attention, NAMES, prefix="comfy"):
            _global.patch(module, name, _global_function("unet" if module is attention else "dit", wrap, upcasts))
    route_vae_blocks()
    return _global.targets() + _blocks.targets()


def _global_function(role: str, wrap, upcasts: bool = True):
    key = ("global", role, upcasts)
    if key not in _functions:
        serve = function(role, upcasts=upcasts)

        def attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                               skip_output_reshape=False, **kwargs):
            run.begin()  # counts the run a graph without the nodes is
            if schedule.position().schedule is not None:
                steps.attention_call(kwargs.get("transformer_options"))
            return serve(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, **kwargs)

        attention_function.__qualname__ = attention_function.__name__ = f"lib_attn_{role}_attention"
        _functions[key] = wrap(attention_function) if wrap is not None else attention_function
    return _functions[key]


def routing() -> voice.Routing:
    if _global.active and _global.intact():
        return voice.ROUTED
    return voice.Routing(False, "ComfyUI's own attention, except the models and VAEs an Attention backend "
                               "node routes", "add the Attention backend nodes, or start ComfyUI with "
                                              "ATTN_COMFY_ROUTE=auto (or a chain of backend ids)")


def undo() -> int:
    """Every rebinding and descriptor back as ComfyUI had it (tests)."""
    return _global.undo() + _blocks.undo()
