"""The engine's attention functions in ComfyUI's convention and the override an Attention backend node
puts on its model (``optimized_attention_override``): what a call reaches once ``route`` has routed it.

* ``function(role, fp32, upcasts)``: the engine's function of ComfyUI's ``(q, k, v, heads, ...)`` form
  (the VAE's ``(q, k, v)`` for ``vae``), with ComfyUI's precision rule where the function it stands in
  for follows it, and batches above ComfyUI's ``SDP_BATCH_LIMIT`` split as ComfyUI splits them.
* ``make_override``: the node's override, keeping an override before it that hands calls on (ComfyUI's
  Model Sparse Attention node's) and replacing, by name, one with a kernel of its own.
"""
from __future__ import annotations

import contextvars
import importlib
import inspect
import re
import sys

import lib_attn

from host_attn import convention

from . import run

SOURCE = "comfy.ldm.modules.attention"
#: The mark of the engine's own overrides: a node put again after this one replaces its override.
ENGINE_OVERRIDE = "_lib_attn_override"
#: The mark of the engine's own attention functions: whether the ComfyUI function each stands in for acts
#: on ``attn_precision`` (``consults_precision``).
ENGINE_FUNCTION = "_lib_attn_consults"
#: (module's last name, qualified name) of the override ComfyUI's Model Sparse Attention node puts on
#: (``comfy_extras/nodes_sparse_attention.py``): it hands the calls it declines on through ``func``.
SPARSE_NODE_OVERRIDE = ("nodes_sparse_attention", "make_attention_override.<locals>.override")

#: (role, fp32, ComfyUI ``BaseModel``, override) of the model an Attention backend node routes, while it
#: samples (None: no such model).
_serving: contextvars.ContextVar = contextvars.ContextVar("lib_attn_comfy_serving", default=None)
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
    read is taken to act on it; an engine function says what it stands in for."""
    marked = getattr(func, ENGINE_FUNCTION, None)
    if marked is not None:
        return marked
    try:
        return _consults[func]
    except (KeyError, TypeError):
        pass
    comfy = getattr(func, "comfy_function", func)   # a rebound name stands for ComfyUI's function
    code = getattr(inspect.unwrap(comfy), "__code__", None)
    found = code is None or "get_attn_precision" in code.co_names
    try:
        _consults[func] = found   # under the name it was asked by: a rebound name's next call finds it
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
    if role != "vae":
        return _heads(role, fp32, upcasts)
    key = (role, fp32)
    if key not in _functions:
        # ComfyUI's VAE attention (``vae_attention()``'s functions) never asks get_attn_precision: under
        # --force-upcast-attention an fp16 VAE still attends in fp16.
        _functions[key] = convention.make_spatial_function(_no_upcast, fp32_rule(fp32))
    return _functions[key]


def _heads(role: str, fp32: str | None = None, upcasts: bool = True):
    """The engine's function of ComfyUI's ``(q, k, v, heads, ...)`` form for ``role`` (a VAE's too)."""
    key = ("heads", role, fp32, upcasts)
    if key not in _functions:
        rule = precision() if upcasts or fp32 else _no_upcast
        made = _in_batches(convention.make_heads_function(role, rule, fp32_rule(fp32)))
        setattr(made, ENGINE_FUNCTION, upcasts)
        _functions[key] = made
    return _functions[key]


def batch_limit():
    """ComfyUI's ``SDP_BATCH_LIMIT``: the largest batch one attention kernel launch takes (2**15 on NVIDIA,
    where PyTorch's kernels fail above it; ComfyUI splits larger batches), or None where it sets none."""
    return getattr(sys.modules.get(SOURCE), "SDP_BATCH_LIMIT", None)


def _in_batches(function_):
    """``function_`` called on slices of at most ``batch_limit()`` batch entries, as ComfyUI's PyTorch
    attention splits a batch (SVD's and AnimateDiff's temporal attention has one entry per pixel)."""
    def attention_function(q, k, v, heads, mask=None, *args, **kwargs):
        limit, b = batch_limit(), q.shape[0]
        if limit is None or b <= limit:
            return function_(q, k, v, heads, mask, *args, **kwargs)
        out = None
        for i in range(0, b, limit):
            part = mask if mask is None or mask.dim() < 3 or mask.shape[0] == 1 else mask[i:i + limit]
            piece = function_(q[i:i + limit], k[i:i + limit], v[i:i + limit], heads, part, *args, **kwargs)
            if out is None:
                out = piece.new_empty((b, *piece.shape[1:]))
            out[i:i + limit] = piece
        return out

    attention_function.__qualname__ = attention_function.__name__ = function_.__name__
    return attention_function


def _stem(module_name) -> str:
    """A module's last name: ``nodes_sparse_attention`` for ``comfy_extras.nodes_sparse_attention`` and for
    the ``/…/comfy_extras/nodes_sparse_attention`` ComfyUI's file loader registers it as."""
    return re.split(r"[\\/.]", module_name or "")[-1]


def _under(override):
    """The override a chaining override hands its declined calls to (its ``previous``), or None."""
    cells = dict(zip(getattr(getattr(override, "__code__", None), "co_freevars", ()), override.__closure__ or ()))
    try:
        return cells["previous"].cell_contents if "previous" in cells else None
    except ValueError:   # an empty cell
        return None


def hands_on(override) -> bool:
    """Whether ``override`` computes every call through the ``func`` it is handed (or declines it to an
    override that does): the engine's own, and ComfyUI's Model Sparse Attention node's with what is under
    it. Others (ComfyUI's Model Attention Backend, KJNodes' Patch Sage Attention) call a kernel of their
    own and drop ``func``."""
    if override is None or getattr(override, ENGINE_OVERRIDE, False):
        return True
    if (_stem(getattr(override, "__module__", "")), getattr(override, "__qualname__", "")) != SPARSE_NODE_OVERRIDE:
        return False
    return hands_on(_under(override))


def describe(override) -> str:
    return f"{getattr(override, '__module__', '?')}.{getattr(override, '__qualname__', repr(override))}"


def _foreign(func, kwargs) -> bool:
    """Whether a call passes a keyword the engine does not take: then ComfyUI's function ``func`` takes
    it, and the run's report says so (never a keyword dropped)."""
    unknown = convention.unknown_keywords(kwargs)
    if unknown:
        run.note(f"attention calls passing {', '.join(unknown)} ran on ComfyUI's own function "
                 f"({getattr(getattr(func, 'comfy_function', func), '__name__', func)}): this extension's engine "
                 f"does not take {'it' if len(unknown) == 1 else 'them'}")
    return bool(unknown)


def make_override(role: str, fp32: str | None = None, previous=None, config: dict | None = None):
    """``optimized_attention_override``: ComfyUI calls it as ``override(func, *args, **kwargs)`` with
    the arguments of the attention function ``func``; the engine serves the call instead. ``previous``,
    an override another node put on the model before this one, keeps its place when it hands calls on
    through ``func`` (``hands_on``: ComfyUI's Model Sparse Attention node): it gets every call first, with
    the engine's function as the ``func`` it computes (or declines) with; a call it computes itself is
    said in the run's report. Any other override is replaced (the last node wins, as with ComfyUI's own
    patch nodes): ``override.replaced`` names it. A ``func`` that is the engine's function of a node put
    on after this one (reaching this override through an override between) runs as that node says.
    ``config``: the node's configuration, put in force for a call made while another model samples (a
    guider's second model); the model's own sampling has it in force already. A call passing a keyword
    the engine does not take goes to ``func`` (``_foreign``)."""
    upcasting, own_dtype = function(role, fp32), function(role, fp32, upcasts=False)
    if getattr(previous, ENGINE_OVERRIDE, False):  # this node again: the override before the first one stays
        previous = previous.previous
    replaced = None
    if previous is not None and not hands_on(previous):
        dropped = _above(previous, None)   # the one with a kernel of its own, under sparse nodes if any
        replaced = describe(dropped) + ("" if dropped is previous else
                                        f", under {describe(previous)}, which hands it the calls it declines")
        previous = None

    def engine(func):
        if getattr(func, ENGINE_FUNCTION, None) is not None:
            return func
        return upcasting if consults_precision(func) else own_dtype

    def own_settings(call, func, args, kwargs):
        serving = _serving.get()
        # another model samples, and no later node of this model hands this call its engine function
        if config and serving is not None and serving[3] is not override and getattr(func, ENGINE_FUNCTION,
                                                                                      None) is None:
            with lib_attn.use(**config, hosted=True):
                return call(func, *args, **kwargs)
        return call(func, *args, **kwargs)

    if previous is None:
        def served(func, *args, **kwargs):
            if kwargs.keys() - convention.ORDINARY and _foreign(func, kwargs):
                return func(*args, **kwargs)
            return engine(func)(*args, **kwargs)
    else:
        reached = [0]
        took_itself = (f"calls computed by the attention override put on before this node ({describe(previous)}), "
                       "not by this node's backend")
        counted = {}
        for chosen in (upcasting, own_dtype):
            counted[chosen] = _counting(chosen, reached)

        def served(func, *args, **kwargs):
            if kwargs.keys() - convention.ORDINARY and _foreign(func, kwargs):
                return previous(func, *args, **kwargs)
            before = reached[0]
            chosen = engine(func)
            out = previous(counted.get(chosen) or _counting(chosen, reached), *args, **kwargs)
            if reached[0] == before:
                run.note(took_itself)
            return out

    def override(func, *args, **kwargs):
        return own_settings(served, func, args, kwargs)

    override.__qualname__ = override.__name__ = f"lib_attn_{role}_override"
    setattr(override, ENGINE_OVERRIDE, True)
    override.previous = previous
    override.replaced = replaced
    return override


def _counting(function_, reached):
    def counted(*args, **kwargs):
        reached[0] += 1
        return function_(*args, **kwargs)
    setattr(counted, ENGINE_FUNCTION, getattr(function_, ENGINE_FUNCTION, True))
    return counted


def _above(current, override):
    """The first override in the chain from ``current`` down to ``override`` that computes calls with a
    kernel of its own (and so keeps them from the node), or None."""
    while current is not None and current is not override and not getattr(current, ENGINE_OVERRIDE, False):
        if (_stem(getattr(current, "__module__", "")), getattr(current, "__qualname__", "")) != SPARSE_NODE_OVERRIDE:
            return current
        current = _under(current)
    return None
