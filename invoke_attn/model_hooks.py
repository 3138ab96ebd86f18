"""Hooks on the attention modules of the models a routed node loads: what the module a call is made in
cannot tell.

* A VAE's attention is the VAE's in any node. diffusers' VAEs (``AutoencoderKL``,
  ``AutoencoderKLFlux2``, ...) reach SDPA through the same attention processors as the UNet and the
  transformers (``diffusers.models.attention_processor``), and denoise and mask nodes run VAEs of their
  own: FLUX.2 encodes its reference images inside ``flux2_denoise``, Z-Image its control image inside its
  denoise node, *Create Gradient Mask* the masked image for inpaint models. Each attention module of a
  model whose class is an autoencoder puts the role "vae" in force for its own call.
* Which processor ran. InvokeAI's ``attention_type`` may give the SD UNet a processor that never calls
  SDPA (sliced, xformers), or not (xformers is used only on older GPUs; IP-Adapter and regional
  prompting put an SDPA processor over any other): each call of an attention module whose processor
  reaches neither SDPA nor diffusers' dispatcher is counted (``work.bypassed``), so that the report says
  what ran on InvokeAI's own processor where it did.

An attention module is a module with a ``processor``. The hooks act only while a node is routed and
change nothing otherwise; ``undo()`` takes them all off.
"""
from __future__ import annotations

import threading
import weakref

import torch

from . import work
from .code_names import names_used

_hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its hooks' handles
_lock = threading.Lock()
_tokens = threading.local()  # each thread's stack of tokens (sessions on several GPUs may share a model)
_reaches: dict = {}  # processor class -> whether its call reaches SDPA or diffusers' dispatcher
ATTENTION_NAMES = {"scaled_dot_product_attention", "dispatch_attention_fn"}


def is_vae(name: str) -> bool:
    """Code that only VAEs run: a module (or a model's class's module) named ``...autoencoder...``."""
    return ".autoencoder" in name


def reaches_attention(processor_class: type) -> bool:
    """Whether a processor's call looks up SDPA or diffusers' dispatcher (where the stand-ins are)."""
    if processor_class not in _reaches:
        code = getattr(getattr(processor_class, "__call__", None), "__code__", None)
        _reaches[processor_class] = code is None or bool(names_used(code) & ATTENTION_NAMES)
    return _reaches[processor_class]


def _enter_vae(module, args):
    stack = getattr(_tokens, "stack", None)
    if stack is None:
        stack = _tokens.stack = []
    stack.append(work.enter_vae())


def _leave_vae(module, args, output):
    stack = getattr(_tokens, "stack", None)
    if stack:
        work.leave(stack.pop())


def _observe(module, args):
    counted = work.bypassed()
    processor = type(getattr(module, "processor", None))
    if counted is not None and not reaches_attention(processor):
        counted[(work.role(), processor.__name__)] += 1


def mark(model) -> int:
    """Hook ``model``'s attention modules (once per model); returns how many it hooked now."""
    if not isinstance(model, torch.nn.Module):
        return 0
    vae = is_vae(type(model).__module__)
    with _lock:
        if model in _hooked:
            return 0
        handles = []
        for module in model.modules():
            if hasattr(module, "processor"):
                if vae:
                    handles.append(module.register_forward_pre_hook(_enter_vae))
                    handles.append(module.register_forward_hook(_leave_vae, always_call=True))
                handles.append(module.register_forward_pre_hook(_observe))
        _hooked[model] = handles
    return sum(1 for m in model.modules() if hasattr(m, "processor"))


def undo() -> int:
    """Take every hook off; returns how many models had them."""
    with _lock:
        models = list(_hooked.items())
        _hooked.clear()
    for _, handles in models:
        for handle in handles:
            handle.remove()
    return len(models)
