"""A VAE's attention is the VAE's in any node.

diffusers' VAEs (``AutoencoderKL``, ``AutoencoderKLFlux2``, ...) reach SDPA through the same attention
processors as the UNet and the transformers (``diffusers.models.attention_processor``), so the module a
call is made in cannot say it is the VAE's. Denoise and mask nodes run VAEs of their own: FLUX.2 encodes
its reference images inside ``flux2_denoise``, Z-Image its control image inside its denoise node, *Create
Gradient Mask* the masked image for inpaint models. When a routed node loads a model whose class is an
autoencoder, each of that model's attention modules (a module with a ``processor``) gets a forward
pre-hook and hook that put the role "vae" in force for its own call while a node is routed, and change
nothing otherwise; the VAE's chain, its schedule rules and the report's VAE line then hold for it.
``undo()`` takes every hook off.
"""
from __future__ import annotations

import threading
import weakref

import torch

from . import work

_hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its hooks' handles
_lock = threading.Lock()


def is_vae(name: str) -> bool:
    """Code that only VAEs run: a module (or a model's class's module) named ``...autoencoder...``."""
    return ".autoencoder" in name


_tokens = threading.local()  # each thread's stack of tokens (sessions on several GPUs may share a VAE)


def _enter(module, args):
    stack = getattr(_tokens, "stack", None)
    if stack is None:
        stack = _tokens.stack = []
    stack.append(work.enter_vae())


def _leave(module, args, output):
    stack = getattr(_tokens, "stack", None)
    if stack:
        work.leave(stack.pop())


def mark(model) -> int:
    """Hook ``model``'s attention modules if it is a VAE (once per model); returns how many it hooked now."""
    if not isinstance(model, torch.nn.Module) or not is_vae(type(model).__module__):
        return 0
    with _lock:
        if model in _hooked:
            return 0
        handles = []
        for module in model.modules():
            if hasattr(module, "processor"):
                handles.append(module.register_forward_pre_hook(_enter))
                handles.append(module.register_forward_hook(_leave, always_call=True))
        _hooked[model] = handles
    return len(handles) // 2


def undo() -> int:
    """Take every hook off; returns how many models had them."""
    with _lock:
        models = list(_hooked.items())
        _hooked.clear()
    for _, handles in models:
        for handle in handles:
            handle.remove()
    return len(models)
