"""Where InvokeAI's models reach attention, and the engine's stand-ins put there.

InvokeAI 6 runs its model families through code of three origins, and each reaches attention by a
name in its module's globals, which is where the stand-ins go (the code itself is never changed):

* diffusers' classes (the SD1.5/SDXL UNet and every VAE through ``AttnProcessor2_0``; Flux2,
  Qwen-Image, Z-Image, Wan, SD3, CogView4 and the other transformers through their processors):
  ``F`` (``torch.nn.functional``) where a module calls ``F.scaled_dot_product_attention``, and
  ``dispatch_attention_fn`` where a transformer's processors call diffusers' dispatcher;
* InvokeAI's own SD attention processor (``CustomAttnProcessor2_0``, which carries IP-Adapter and
  regional prompting): its ``F``, so that it keeps doing all of that, on the engine;
* InvokeAI's own models (FLUX.1, Anima, Krea-2, Ideogram-4, their autoencoders): FLUX.1's
  ``attention`` function wherever it is imported by name, and ``F``, ``nn`` or a bare
  ``scaled_dot_product_attention`` where a module calls SDPA itself.

Every stand-in asks ``work.role()`` at each call: a call made while no routed node runs (a text
encoder, a session nothing routes) goes to the original exactly as made and is not counted. Code
only VAEs run (an ``autoencoder`` module) counts as the VAE whichever node runs it, and so do the
attention modules of a VAE model that diffusers' shared processors serve (``model_hooks``).

A module is examined once, the first time it is found fully imported (one another thread is still
importing is left for a later scan): ``route()`` runs when a routed node starts and again after it
loads a model (diffusers imports a model's module only then). What reaches
SDPA through ``torch.nn.functional`` spelled out in full (the XLabs and InstantX FLUX IP-Adapter's
extra attention) cannot be reached this way and stays on PyTorch's SDPA, uncounted. ``undo()`` puts
every replaced name back.
"""
from __future__ import annotations

import sys
import threading
import types

import torch
import torch.nn.functional as F

from host_attn import voice
from host_attn.patching import Patches
from lib_attn.integrations.diffusers import served_dispatch, served_functional, served_sdpa

from . import flux_attention, model_hooks, work
from .code_names import names_used

PREFIXES = ("diffusers.models.", "invokeai.backend.")
SDPA = "scaled_dot_product_attention"

_patches = Patches("InvokeAI")
_examined: set = set()
_served: dict = {}
_lock = threading.Lock()


def _codes(value):
    """The code objects of a function, or of the functions of a class defined in the module."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for part in (value.fget, value.fset):
            yield from _codes(part)
        return
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        yield code
    elif isinstance(value, type):
        for member in vars(value).values():
            yield from _codes(member)


def _module_names(module) -> set:
    """Every name the code defined in ``module`` (its functions, its classes' methods) looks up."""
    names: set = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) == module.__name__:
            for code in _codes(value):
                names |= names_used(code)
    return names


def _stand_in(kind: str, role, original=None):
    """One stand-in per (kind, role function, original), shared by every module that gets it."""
    key = (kind, role, original)
    if key not in _served:
        if kind == "functional":
            _served[key] = served_functional(role)
        elif kind == "nn":
            nn = types.ModuleType("lib_attn.nn.served")
            nn.__dict__.update({k: v for k, v in vars(torch.nn).items() if not k.startswith("__")})
            nn.functional = served_functional(role)
            _served[key] = nn
        elif kind == "sdpa":
            _served[key] = served_sdpa(role)
        elif kind == "dispatch":
            _served[key] = served_dispatch(role, original)
        else:
            _served[key] = flux_attention.make(original, role)
    return _served[key]


#: The modules that define what the scan replaces elsewhere: never changed themselves, so that a module
#: imported later imports the original (and the next scan finds it) and undo stays exact.
SOURCES = ("diffusers.models.attention_dispatch", "invokeai.backend.flux.math")


def _originals() -> dict:
    """id of each original the scan looks for -> (its kind, the original)."""
    found = {id(F): ("functional", None), id(torch.nn): ("nn", None), id(F.scaled_dot_product_attention): ("sdpa", None)}
    real = getattr(sys.modules.get(SOURCES[0]), "dispatch_attention_fn", None)
    if real is not None:
        found[id(real)] = ("dispatch", real)
    real = getattr(sys.modules.get(SOURCES[1]), "attention", None)
    if real is not None:
        found[id(real)] = ("flux", real)
    return found


def _examine(name: str, module, originals: dict) -> list[str]:
    namespace = getattr(module, "__dict__", None)
    if name in SOURCES or not isinstance(namespace, dict):
        return []
    role = work.vae_role if model_hooks.is_vae(name) else work.role
    routed, used = [], None
    for attr, value in list(namespace.items()):
        hit = originals.get(id(value))
        if hit is None or _patches.is_patched(module, attr):
            continue
        kind, original = hit
        if kind in ("functional", "nn"):
            # Most modules hold torch.nn (and F) for their layers and activations: only one whose own
            # code reaches SDPA through it gets the stand-in.
            used = _module_names(module) if used is None else used
            if SDPA not in used or (kind == "nn" and "functional" not in used):
                continue
        _patches.patch(module, attr, _stand_in(kind, role, original))
        routed.append(f"{name}.{attr}")
    return routed


def _importing(module) -> bool:
    """Whether ``module`` is still being imported (in another thread: a session on another GPU loading its
    model): its names are not all bound yet, so it is examined at a later ``route()``, once they are.
    The import system marks a module's spec ``_initializing`` while it runs the module's code."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def route() -> list[str]:
    """Put the stand-ins into every loaded module not examined yet; returns what it routed now."""
    with _lock:
        fresh = [(name, module) for name, module in list(sys.modules.items())
                 if name.startswith(PREFIXES) and name not in _examined and module is not None
                 and not _importing(module)]
        if not fresh:
            return []
        originals = _originals()
        routed = []
        for name, module in fresh:
            _examined.add(name)
            routed += _examine(name, module, originals)
    if routed:
        modules = sorted({where.rsplit(".", 1)[0] for where in routed})
        voice.log(f"InvokeAI: attention routed through lib_attn at {len(routed)} names in {len(modules)} modules "
                  f"({', '.join(modules[:3])}{', …' if len(modules) > 3 else ''})")
    return routed


def routed() -> list[str]:
    """``module.name`` of every stand-in in place."""
    return _patches.targets()


def undo() -> int:
    """Put every replaced name back and take the VAE hooks off; the next ``route()`` examines every
    module again. Returns how many names it put back."""
    model_hooks.undo()
    with _lock:
        _examined.clear()
        return _patches.undo()
