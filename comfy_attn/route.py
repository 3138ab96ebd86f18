"""Routing ComfyUI's attention through the engine, from narrowest to widest.

* One model (the Attention backend node): ComfyUI wraps every attention function in ``wrap_attn``,
  which calls ``transformer_options["optimized_attention_override"](func, *args, **kwargs)`` when a
  call passes the model's options: most calls of most families (SD1.5/SDXL, Flux, SD3, Wan,
  Qwen-Image, Lumina, HunyuanVideo, …) then reach ``override``. Calls that pass no options (PixArt,
  Hunyuan-DiT, Ernie-Image, ACE-Step 1.5, Hunyuan3D 2.1, Wan Animate's face attention, MultiTalk's
  audio attention, the SAG node's) reach the rebound module names below, which serve them for the
  model being sampled. An ``OUTER_SAMPLE`` wrapper puts the node's configuration in force while that
  model samples, says which model that is, and counts the run; while a schedule is in force it also
  has the model's blocks tell the engine where they start (``lib_attn.schedule.blocks``), and an
  ``APPLY_MODEL`` wrapper tells it the step of each model call (``steps.model_call``); while sparse
  attention is on, its joint blocks tell their text tokens (``text``).
* One VAE (the VAE attention backend node): VAE blocks store their function when built and no
  wrapper reaches them, so a class descriptor (``Patches.patch_stored``) gives them the engine's
  function while a routed VAE's encode or decode runs; the VAE object ComfyUI caches keeps its own.
* Module names: every loaded ComfyUI module's ``optimized_attention`` / ``optimized_attention_masked``
  that is ComfyUI's chosen function (the SAG node's module of ``comfy_extras`` too), and every custom
  node pack's module holding it (IPAdapter_plus's, by name or under a name of its own), is rebound,
  once a node or the global route is used and again at each sampling when modules were loaded since,
  to a function wrapped in ComfyUI's own ``wrap_attn`` (overrides still apply) that serves a call on
  the engine while a routed model samples (its role; only that model's calls: ``BaseModel.apply_model``
  says which model a call is), while a routed VAE runs (``vae``) or under the global route (the module's
  role), and hands it to ComfyUI's function otherwise. Text, audio and image encoders keep ComfyUI's
  function. ``scale`` and ``enable_gqa`` are honoured; a call passing a keyword the engine does not take
  runs on ComfyUI's function, named in the report; a batch above ComfyUI's ``SDP_BATCH_LIMIT`` is split
  as ComfyUI splits it.
* Every model and VAE (the global route, ``ATTN_COMFY_ROUTE`` or ComfyUI's own
  ``--use-flash-attention`` / ``--use-sage-attention`` with this package installed): the module
  names serve every call, and the VAE blocks see the engine's function always. ``BaseModel.apply_model``
  (on the class) serves each model call's attention as its model's role and tells the step, calls that
  pass no options included; outside a model call the step is followed from the attention calls (a new
  ``sigmas`` tensor is a new model call; a call that passes no options has no step). The blocks are
  not known. Each sampling and each VAE pass is a segment of the run: its report goes to the page.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import itertools
import os
import re
import sys

import lib_attn
from lib_attn import schedule

from host_attn import convention, voice
from host_attn.patching import Patches
from host_attn.rebind import copies, import_quietly

from . import run, steps, text
from .calls import (SOURCE, _above, _consults, _foreign, _functions, _heads, _serving, consults_precision, describe,
                    function, make_override)

NAMES = ("optimized_attention", "optimized_attention_masked")
#: (module, class): VAE blocks that store their attention function as ``optimized_attention`` when built.
VAE_BLOCKS = (
    ("comfy.ldm.modules.diffusionmodules.model", "AttnBlock"),
    ("comfy.ldm.wan.vae", "AttentionBlock"),
    ("comfy.ldm.cosmos.cosmos_tokenizer.layers3d", "CausalAttnBlock"),
    ("comfy.ldm.mmaudio.vae.vae_modules", "AttnBlock1D"),
)
#: ComfyUI's modules whose attention is an encoder's (text, audio, image) or no generation's: they keep
#: ComfyUI's function.
ENCODER_MODULES = ("comfy.text_encoders", "comfy.audio_encoders", "comfy.clip_model", "comfy.clip_vision",
                   "comfy.image_encoders", "comfy.ldm.rt_detr")
#: ComfyUI's modules whose attention serves a VAE (role ``vae`` under the global route).
VAE_MODULES = ("comfy.ldm.genmo.vae", "comfy.ldm.cosmos.cosmos_tokenizer", "comfy.ldm.wan.vae",
               "comfy.ldm.mmaudio.vae", "comfy.ldm.modules.diffusionmodules.model", "comfy.ldm.lightricks.vae")
#: Files of ``comfy_extras`` (less ``.py``) whose attention serves a UNet: the SAG node's (it replaces a
#: UNet's middle self-attention).
UNET_FILES = ("nodes_sag",)
#: Modules of ``comfy`` outside ``comfy.ldm.modules.attention`` whose attention serves a UNet: the UNet
#: ControlNet's (its union blocks).
UNET_MODULES = ("comfy.cldm.cldm",)
WRAPPER_KEY = "flash_attention"
UNET_CLASS = ("comfy.ldm.modules.diffusionmodules.openaimodel", "UNetModel")

#: The configuration of the routed VAE whose encode/decode runs now (None: ComfyUI's own attention).
_vae_config: contextvars.ContextVar = contextvars.ContextVar("lib_attn_vae_config", default=None)
#: (ComfyUI ``BaseModel``, its role) of the model whose call (``BaseModel.apply_model``) runs now (None: none).
_model_call: contextvars.ContextVar = contextvars.ContextVar("lib_attn_comfy_model_call", default=None)
_blocks = Patches("comfy-vae")
_names = Patches("comfy-names")
#: The end of each prompt (``_prompts_end_with_a_report``): no attention runs there, so it is neither what is
#: routed nor part of whether the routing is intact (packs wrap ``PromptExecutor.execute`` too, to time prompts).
_prompts = Patches("comfy-prompts")
_everything = [False]   # the global route is on
_scanned = [0]          # len(sys.modules) when the names were last looked for
_read: set = set()      # the modules _renamed has read
_unreachable: list = [] # where packs' modules keep ComfyUI's function beyond any rebinding (``_held``)
#: The entries of a pack's dict read for copies, at most (a dict that large is a table, not a registry).
MAX_HELD = 256


def role_of(model_patcher) -> str:
    """``unet`` for SD1.5/SD2/SDXL's UNet, ``dit`` for every other denoiser."""
    return _denoiser_role(getattr(model_patcher, "model", None))


def _denoiser_role(base_model) -> str:
    """The role of ComfyUI's ``BaseModel`` ``base_model``: its diffusion model's class says."""
    module, name = UNET_CLASS
    unet = getattr(sys.modules.get(module), name, None)
    diffusion = getattr(base_model, "diffusion_model", None)
    return "unet" if unet is not None and isinstance(diffusion, unet) else "dit"


# --- one model --------------------------------------------------------------------------------------

def make_sample_wrapper(config: dict, role: str = "unet", fp32: str | None = None, replaced: str | None = None,
                        override=None):
    """An ``OUTER_SAMPLE`` wrapper: the model samples under ``config``, counted in the run, and the
    calls that pass no options are served as ``role`` with ``fp32``; ``replaced``, the override the node
    took the place of, is said in the run's report. While a schedule or sparse dense
    windows are in force, the blocks of the model being sampled (the guider's, ``executor.class_obj``)
    tell the engine where they start; no step is known before or after. The calls that pass no options
    are served so only while they are this model's (the guider's ``model_patcher``'s): another model a
    guider calls runs on its own settings. ``override``: the node's, which serves this model's calls; an
    override put on after it that computes calls with a kernel of its own is named in the report with
    the calls it took (``_taken_after``)."""
    def wrapper(executor, *args, **kwargs):
        rebind_names()   # a pack loaded after the node was run (ComfyUI loads folders in no set order)
        _say_unreachable()
        model = getattr(getattr(executor.class_obj, "model_patcher", None), "model", None)
        token = _serving.set((role, fp32, model, override))
        if replaced:
            run.note(f"the attention override put on before this node ({replaced}) computes its calls with a kernel "
                     "of its own: this node replaced it")
        try:
            return _sample(executor, config, _taken_after(executor.class_obj, override), *args, **kwargs)
        finally:
            _serving.reset(token)
    return wrapper


def _taken_after(guider, override):
    """Where an override put on the model after the node (KJNodes' Patch Sage Attention, ComfyUI's Model
    Attention Backend) would take the calls that pass options, this sampling's copy of the options gets
    it counted; returns the note to make at the end (or None)."""
    options = (getattr(guider, "model_options", None) or {}).get("transformer_options")
    current = options.get("optimized_attention_override") if isinstance(options, dict) else None
    foreign = _above(current, override) if override is not None else None
    if foreign is None:
        return None
    taken = [0]

    def counted(*args, **kwargs):
        taken[0] += 1
        return current(*args, **kwargs)
    options["optimized_attention_override"] = counted   # the guider's copy, for this sampling only

    def note():
        if taken[0]:
            run.note(f"{taken[0]} attention calls were computed by {describe(foreign)}, an attention override put "
                     "on after this node, with a kernel of its own; this node's backend served the calls that "
                     "pass no options")
    return note


def _sample(executor, config, note_taken, *args, **kwargs):
    with run.segment(config), contextlib.ExitStack() as hooks:
        try:
            if lib_attn.config().sparse is not None:  # joint blocks tell their text tokens (kept by sparse)
                hooks.enter_context(text.told(executor.class_obj.model_patcher.model.diffusion_model))
            if lib_attn.config().positional is None:
                return executor(*args, **kwargs)
            steps.leave()
            try:
                with schedule.blocks(executor.class_obj.model_patcher.model.diffusion_model):
                    return executor(*args, **kwargs)
            finally:
                steps.leave()
        finally:
            if note_taken is not None:
                note_taken()


def model_call_wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={},
                       **kwargs):
    """An ``APPLY_MODEL`` wrapper (called as ``BaseModel.apply_model`` calls it): the engine is told
    the step of this model call, once, before its attention calls."""
    steps.model_call(transformer_options)
    return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


def route_model(model_patcher, config: dict, fp32: str | None = None):
    """A clone of ``model_patcher`` whose attention runs on the engine under ``config``."""
    from comfy.patcher_extension import WrappersMP

    rebind_names()
    model = model_patcher.clone()
    role = role_of(model)
    options = model.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    override = options["optimized_attention_override"] = make_override(role, fp32, previous, config)
    for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.APPLY_MODEL):
        model.remove_wrappers_with_key(kind, WRAPPER_KEY)
    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY,
                               make_sample_wrapper(config, role, fp32, override.replaced, override))
    model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, model_call_wrapper)
    return model


# --- VAE blocks ---------------------------------------------------------------------------------------

def _vae_routed() -> bool:
    return _vae_config.get() is not None or _everything[0]


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
    ``config``; the original (which ComfyUI caches between graphs) is left as it is. A VAE another
    node routed is routed afresh from its own methods: the last node in a chain wins, as with the
    model nodes, and each encode or decode is one segment of the run."""
    import copy

    route_vae_blocks()
    rebind_names()   # a video VAE's attention that calls ComfyUI's module function (Mochi's)
    routed = copy.copy(vae)
    for name in VAE_METHODS:
        method = getattr(vae, name, None)
        if method is not None:
            setattr(routed, name, _in_vae_segment(getattr(method, "vae_method", method), config))
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
    routed.vae_method = method
    return routed


# --- module names and the global route ----------------------------------------------------------------

def _extras_file(module, root: str) -> str | None:
    """The file name (less ``.py``) of a module ComfyUI loaded from its ``comfy_extras`` folder (the SAG
    node's), or None. ComfyUI names such a module by its path and builds that path from its real location,
    while ``root`` may come through a symbolic link: both are compared resolved."""
    path = getattr(module, "__file__", None) or ""
    if not path or os.path.dirname(os.path.realpath(path)) != os.path.join(root, "comfy_extras"):
        return None
    return os.path.splitext(os.path.basename(path))[0]


def _comfy_model_module(module_name: str, module, root: str) -> bool:
    """A module of ComfyUI's own (its ``comfy`` package, or a file of ``comfy_extras``) that is no encoder's."""
    if module_name.startswith(ENCODER_MODULES):
        return False
    if module_name.startswith("comfy.") or module_name == "comfy":
        return True
    return _extras_file(module, root) is not None


def _rebinds(module_name: str, module, root: str) -> bool:
    """Whether the name a module holds is rebound: ComfyUI's model modules, and any other module (a custom
    node pack's, such as IPAdapter_plus's patch module, which imports ``optimized_attention`` by name and
    calls it without options) that is not one of ComfyUI's encoders or its own code outside ``comfy``."""
    if module_name.startswith(ENCODER_MODULES):
        return False
    if module_name.startswith(("comfy.", "comfy_")) or module_name == "comfy":
        return _comfy_model_module(module_name, module, root)
    return True


def _module_role(module_name: str, module, attention, root: str) -> str:
    """The role a module's calls are served as under the global route outside a model call; a pack's
    module serves as ComfyUI's attention module does (a pack loaded after this package imports that
    module's rebound name itself)."""
    if not (module_name.startswith("comfy.") or _extras_file(module, root) is not None):
        return "unet"
    if module_name.startswith(VAE_MODULES):
        return "vae"
    if module_name in (attention.__name__, *UNET_MODULES) or _extras_file(module, root) in UNET_FILES:
        return "unet"
    return "dit"


def rebind_names() -> list[str]:
    """Rebind ComfyUI's chosen function wherever a loaded module (``_rebinds``) holds it (once per
    module; a module loaded later is reached at the next call of this, which each sampling makes when
    modules were loaded since), and have each model call say its model; returns what is rebound."""
    if len(sys.modules) == _scanned[0] and _names.active:
        return _names.targets()
    _scanned[0] = len(sys.modules)
    _model_calls_say_their_role()
    attention = importlib.import_module(SOURCE)
    wrap = getattr(attention, "wrap_attn", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(attention.__file__)))))
    chosen = [_names.original(attention, name) for name in NAMES if hasattr(attention, name)]
    for module_name, module, name in copies(attention, NAMES, values=chosen) + _renamed(chosen):
        if _rebinds(module_name, module, root) and not _names.is_patched(module, name):
            original = getattr(module, name)
            _names.patch(module, name, _rebound(_module_role(module_name, module, attention, root), original, wrap))
    return _names.targets()


def _renamed(chosen) -> list:
    """(module name, module, attribute) where a module outside ComfyUI's own holds ComfyUI's chosen function
    under a name of its own (``from comfy.ldm.modules.attention import optimized_attention as attn``, or a
    pack's ``attention_fn = attention_pytorch`` where that is the chosen one). Each module is read once (a
    module's names are bound when it is imported): about 0.03 ms a module. A custom node pack's module is
    also read for copies no rebinding reaches (``_held``)."""
    ids = {id(value) for value in chosen}
    found = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module_name in _read or not isinstance(namespace, dict) or module_name.startswith(
                ("comfy", "torch", "lib_attn", "host_attn")):
            continue
        _read.add(module_name)
        found.extend((module_name, module, name) for name, value in list(namespace.items())
                     if id(value) in ids and name not in NAMES)
        if _pack_module(module_name, module):
            _unreachable.extend(_held(module_name, module, namespace, ids))
    return found


def _pack_module(module_name: str, module) -> bool:
    """A custom node pack's module: ComfyUI's loader names a pack (and so its submodules) by its folder's path;
    a pack that puts its folder on ``sys.path`` has modules of plain names, found by their file's folder."""
    if "/" in module_name or "\\" in module_name:
        return True
    path = getattr(module, "__file__", None) or ""
    folder_paths = sys.modules.get("folder_paths")
    roots = getattr(folder_paths, "get_folder_paths", lambda _: [])("custom_nodes") if folder_paths else []
    real = os.path.realpath(path) if path else ""
    return bool(real) and any(real.startswith(os.path.join(os.path.realpath(root), "")) for root in roots)


def _held(module_name: str, module, namespace: dict, ids: set) -> list[str]:
    """Where a pack's module keeps ComfyUI's chosen function in a dict of its own (``{"comfy": optimized_attention}``)
    or as an attribute of a class it defines (``attention = staticmethod(optimized_attention)``): calls made
    through those reach ComfyUI's function, which no rebinding of a name reaches, so the report names them."""
    shown = re.split(r"[\\/]", module_name)[-1]
    where = []
    # Values are told apart by their type alone: ``isinstance`` and ``getattr`` ask the value itself, which a
    # proxy outside its context or a lazy object answers by raising; and a dict's first entries only are read.
    for name, value in list(namespace.items()):
        if issubclass(type(value), dict):
            entries = itertools.islice(dict.items(value), MAX_HELD)
            where.extend(f"{shown}.{name}[{key!r}]" for key, held in list(entries) if id(held) in ids)
        elif issubclass(type(value), type) and vars(value).get("__module__") == namespace.get("__name__"):
            for attr, held in list(vars(value).items()):
                if id(held.__func__ if type(held) in (staticmethod, classmethod) else held) in ids:
                    where.append(f"{shown}.{name}.{attr}")
    return where


def _say_unreachable() -> None:
    """The run's report names the copies of ComfyUI's function that packs keep where no rebinding reaches."""
    if _unreachable:
        run.note(f"ComfyUI's attention function is also kept in {', '.join(_unreachable)} (a custom node pack's "
                 "dict or class attribute), where this extension cannot put its own: calls made through it run on "
                 "ComfyUI's attention and are not counted here")


def _rebound(module_role: str, original, wrap):
    """The function a rebound name holds: the engine serves the call as the model sampling now says (while
    the call is that model's, or no model's call), the VAE running now, or (global route) the model whose
    call runs now or else the module; otherwise ComfyUI's ``original`` takes it, as it takes a call passing
    a keyword the engine does not take."""
    upcasts = consults_precision(original)

    def attention_function(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
        serving, vae = _serving.get(), _vae_config.get()
        if serving is None and vae is None and not _everything[0]:   # no routed model or VAE runs: ComfyUI's
            return original(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, **kwargs)
        inside = _model_call.get()
        if serving is not None and (inside is None or serving[2] is None or inside[0] is serving[2]):
            role, fp32 = serving[0], serving[1]
        elif vae is not None:
            role, fp32 = "vae", vae.get("fp32")
        elif _everything[0]:
            role, fp32 = (inside[1] if inside is not None else module_role), None
            run.begin()  # counts the run a graph without the nodes is
            if inside is None and schedule.position().schedule is not None:
                steps.attention_call(kwargs.get("transformer_options"))
        else:
            role = None
        if role is None or (kwargs.keys() - convention.ORDINARY and _foreign(original, kwargs)):
            return original(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, **kwargs)
        return _heads(role, fp32, upcasts)(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape,
                                           **kwargs)

    attention_function.__qualname__ = attention_function.__name__ = f"lib_attn_{module_role}_attention"
    attention_function.comfy_function = original
    wrapped = wrap(attention_function) if wrap is not None else attention_function
    wrapped.comfy_function = original
    return wrapped


def route_everything(config: dict | None = None) -> list[str]:
    """Serve every call of ComfyUI's module names and every VAE block on the engine; returns what was
    routed. ``config`` is put in force for good."""
    if config:
        lib_attn.configure(**config, hosted=True)
    _everything[0] = True
    rebind_names()
    route_vae_blocks()
    _passes_as_vae()
    _samplings_are_segments()
    _prompts_end_with_a_report()
    return _names.targets() + _blocks.targets()


def _model_calls_say_their_role() -> None:
    """Each model call (``BaseModel.apply_model``) says which model it is: a node's model serves only its
    own calls through the rebound names, and under the global route a model no node routes serves its
    calls as its role and tells the engine its step (LTXV and LTX-2 call the UNet's attention module, and
    calls that pass no options carry no sigma to follow)."""
    base = getattr(sys.modules.get("comfy.model_base"), "BaseModel", None)
    method = base.__dict__.get("apply_model") if base is not None else None
    if method is not None and not _names.is_patched(base, "apply_model"):
        _names.patch(base, "apply_model", _as_model_call(method))


def _as_model_call(method):
    """Each model call says which model it is (``_model_call``: a node's model serves only its own calls);
    under the global route, a model no node samples also tells its step."""
    def model_call(self, *args, **kwargs):
        token = _model_call.set((self, _denoiser_role(self)))
        try:
            if _everything[0] and _serving.get() is None:   # a node's model: its wrappers tell the step
                steps.model_call(kwargs.get("transformer_options", args[5] if len(args) > 5 else None))
            return method(self, *args, **kwargs)
        finally:
            _model_call.reset(token)
    model_call.__name__, model_call.__qualname__ = method.__name__, method.__qualname__
    return model_call


def _passes_as_vae() -> None:
    """Every encode and decode of ComfyUI's ``VAE`` serves its calls as ``vae`` (SVD's temporal VAE
    calls the function the UNet's attention module holds)."""
    sd = sys.modules.get("comfy.sd")
    cls = getattr(sd, "VAE", None)
    for name in VAE_METHODS:
        method = cls.__dict__.get(name) if cls is not None else None
        if method is not None and not _names.is_patched(cls, name):
            _names.patch(cls, name, _as_vae(method))


def _as_vae(method):
    def vae_pass(self, *args, **kwargs):
        if _vae_config.get() is not None:   # a routed VAE's pass: its node's configuration
            return method(self, *args, **kwargs)
        token = _vae_config.set({})
        try:
            with run.segment() as current:   # its report goes to the page when it ends
                images = method(self, *args, **kwargs)
                run.remember(images, current)
                return images
        finally:
            _vae_config.reset(token)
    vae_pass.__name__, vae_pass.__qualname__ = method.__name__, method.__qualname__
    return vae_pass


def _samplings_are_segments() -> None:
    """Under the global route each sampling (``CFGGuider.outer_sample``) is a segment of the run, whose
    report goes to the page when it ends, as a node's sampling is; modules loaded since the last sampling
    (a pack loaded after this package) have their names rebound first."""
    samplers, _ = import_quietly("comfy.samplers")   # ComfyUI's nodes.py has it loaded already
    cls = getattr(samplers, "CFGGuider", None)
    method = cls.__dict__.get("outer_sample") if cls is not None else None
    if method is not None and not _names.is_patched(cls, "outer_sample"):
        _names.patch(cls, "outer_sample", _as_segment(method))


def _as_segment(method):
    def outer_sample(self, *args, **kwargs):
        if _serving.get() is not None:   # a node's model: its own wrapper made the segment
            return method(self, *args, **kwargs)
        rebind_names()
        with run.segment():
            _say_unreachable()
            return method(self, *args, **kwargs)
    outer_sample.__name__, outer_sample.__qualname__ = method.__name__, method.__qualname__
    return outer_sample


def _prompts_end_with_a_report() -> None:
    """Under the global route a prompt that sent no report (everything that ran attention came from ComfyUI's
    cache, and no report node ran) sends, when ComfyUI's executor ends it (``PromptExecutor.execute``), the
    report of the run that made the images its cache entries hold, with the cache note (``run.prompt_ended``)."""
    execution, _ = import_quietly("execution")   # ComfyUI's main.py has it loaded before the custom nodes
    cls = getattr(execution, "PromptExecutor", None)
    method = cls.__dict__.get("execute") if cls is not None else None
    if method is not None and not _prompts.is_patched(cls, "execute"):
        _prompts.patch(cls, "execute", _ends_with_a_report(method))


def _ends_with_a_report(method):
    def execute(self, prompt, prompt_id, *args, **kwargs):
        try:
            return method(self, prompt, prompt_id, *args, **kwargs)
        finally:
            if _everything[0]:
                run.prompt_ended(prompt_id, _cached_outputs(self, prompt))
    execute.__name__, execute.__qualname__ = method.__name__, method.__qualname__
    return execute


def _cached_outputs(executor, prompt) -> list:
    """The values ComfyUI's output cache holds for the nodes of ``prompt`` after it ran: each node's
    ``CacheEntry.outputs`` (``caches.outputs.get_local`` in 0.19, where ``get`` is a coroutine; ``get`` in 0.8)."""
    cache = getattr(getattr(executor, "caches", None), "outputs", None)
    get = getattr(cache, "get_local", None) or getattr(cache, "get", None)
    values = []
    for node_id in prompt if get is not None else ():
        try:
            entry = get(node_id)
        except Exception:  # noqa: BLE001 - a cache this package does not know: no note rather than a failed prompt
            continue
        if inspect.isawaitable(entry):
            getattr(entry, "close", lambda: None)()
            continue
        for output in getattr(entry, "outputs", None) or ():
            values.extend(output if isinstance(output, (list, tuple)) else (output,))
    return values


def routing() -> voice.Routing:
    if _everything[0] and _names.active and _names.intact():
        return voice.ROUTED
    return voice.Routing(False, "ComfyUI's own attention, except the models and VAEs an Attention backend "
                               "node routes", "add the Attention backend nodes, or start ComfyUI with "
                                              "ATTN_COMFY_ROUTE=auto (or a chain of backend ids)")


def undo() -> int:
    """Every rebinding and descriptor back as ComfyUI had it (tests)."""
    _everything[0] = False
    _scanned[0] = 0
    _read.clear()
    _unreachable.clear()
    _functions.clear()   # they hold the precision rule of the ComfyUI they were made for
    _consults.clear()
    return _names.undo() + _blocks.undo() + _prompts.undo()
