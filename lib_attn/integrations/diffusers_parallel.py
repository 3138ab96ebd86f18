"""Splitting a diffusers denoiser's sequence over the ranks of a ``lib_attn.parallel.Parallel``, for
``route(pipe, parallel=...)`` under ``torchrun --nproc-per-node N``.

Every rank runs the whole pipeline with the same inputs (text encoders, VAE and scheduler as before, so
every rank holds the same latents); inside the denoiser, hooks split the token sequence where it enters
and gather it where it leaves, and each attention call is said to be self, cross or joint by the module
that makes it, never guessed from its lengths (``CallKind``). Known models:

* Flux (``FluxTransformer2DModel``): the image tokens ``hidden_states`` and their positions ``img_ids``
  are split as the model is called; the text is not. Every attention call is joint (the text in front),
  with the text length the model was called with. The output is gathered after ``proj_out``.
* Wan (``WanTransformer3DModel``): the rotary embedding's output and the tokens entering ``blocks[0]``
  are split; ``attn1`` is self-attention, ``attn2`` cross-attention to the text (and image) context,
  which every rank holds whole. Gathered after ``proj_out``. A per-token timestep (Wan 2.2 TI2V) is
  refused.
* UNets (``UNet2DConditionModel``): convolutions need their neighbours, so only the transformer blocks
  are split: each ``BasicTransformerBlock`` splits its tokens on entry and gathers them on exit;
  ``attn1`` is self-attention, ``attn2`` cross-attention.

Any other denoiser is refused, naming its class and the ones known.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from .. import parallel as _parallel

KNOWN = ("FluxTransformer2DModel", "WanTransformer3DModel", "UNet2DConditionModel")

#: (kind, text_len, seq_len) of the attention call being made, set around the attention module's forward.
_call: ContextVar = ContextVar("lib_attn_diffusers_call", default=None)
#: Split scopes open in this process. While none is, a routed call reads nothing else: a plain module
#: global, which torch.compile can trace (a context variable it cannot).
_open = 0


def current_call():
    """(kind, text_len, seq_len) of the attention module running now, or None outside one."""
    return _call.get()


def attend(query, key, value, layout: str, mask, scale, role: str, attention):
    """A routed call: split over the ranks when a split module makes it, else ``attention`` as before."""
    found = _call.get() if _open else None
    if found is None or _parallel.current() is None:
        return attention(query, key, value, layout=layout, mask=mask, scale=scale, role=role)
    kind, text_len, seq_len = found
    return _parallel.attention(query, key, value, kind=kind, text_len=text_len, seq_len=seq_len, layout=layout,
                               mask=mask, scale=scale, role=role)


class _Split:
    """The state of one routed denoiser: its configuration and the lengths it split."""

    def __init__(self, par):
        self.par = par
        self.total = None      # whole length of the split sequence, set where it is split
        self.text_len = 0

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _parallel.shard(x, dim, self.par.world, self.par.rank)

    def gather(self, x: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        return _parallel.gather(x, dim, self.par, total=total)


def _kind_hooks(stack: contextlib.ExitStack, module, kind_of) -> None:
    """Say the kind of the attention calls ``module`` makes (``kind_of()`` -> (kind, text_len, seq_len))
    for the length of its forward, an exception included."""
    tokens = []

    def enter(mod, args):
        tokens.append(_call.set(kind_of()))

    def leave(mod, args, out):
        if tokens:
            _call.reset(tokens.pop())

    stack.callback(module.register_forward_pre_hook(enter).remove)
    stack.callback(module.register_forward_hook(leave, always_call=True).remove)


def _first_arg(args, kwargs, name: str):
    return kwargs[name] if name in kwargs else (args[0] if args else None)


def _replace_first(args, kwargs, name: str, value):
    if name in kwargs:
        return args, {**kwargs, name: value}
    return (value, *args[1:]), kwargs


def _flux(stack, model, state: _Split) -> None:
    def split_inputs(mod, args, kwargs):
        hidden = _first_arg(args, kwargs, "hidden_states")
        text = kwargs.get("encoder_hidden_states")
        if text is None:
            raise ValueError("parallel Flux: the transformer must be called with encoder_hidden_states= (the text), "
                             "as FluxPipeline does")
        state.total, state.text_len = hidden.shape[1], text.shape[1]
        args, kwargs = _replace_first(args, kwargs, "hidden_states", state.shard(hidden, 1))
        ids = kwargs.get("img_ids")
        if ids is not None:
            kwargs = {**kwargs, "img_ids": state.shard(ids, ids.dim() - 2)}
        return args, kwargs

    stack.callback(model.register_forward_pre_hook(split_inputs, with_kwargs=True).remove)
    stack.callback(model.proj_out.register_forward_hook(lambda m, a, out: state.gather(out, 1, state.total)).remove)
    for name, module in model.named_modules():
        if hasattr(module, "processor") and name:
            _kind_hooks(stack, module, lambda: ("joint", state.text_len, state.total))


def _wan(stack, model, state: _Split) -> None:
    def refuse_token_timesteps(mod, args, kwargs):
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if timestep is not None and timestep.dim() == 2:
            raise ValueError("parallel Wan: a per-token timestep (Wan 2.2 TI2V) is not split; use a model with one "
                             "timestep per sample")

    def split_rope(mod, args, out):
        state.total = out[0].shape[1]
        return tuple(state.shard(t, 1) for t in out)

    def split_tokens(mod, args, kwargs):
        hidden = _first_arg(args, kwargs, "hidden_states")
        return _replace_first(args, kwargs, "hidden_states", state.shard(hidden, 1))

    stack.callback(model.register_forward_pre_hook(refuse_token_timesteps, with_kwargs=True).remove)
    stack.callback(model.rope.register_forward_hook(split_rope).remove)
    stack.callback(model.blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True).remove)
    stack.callback(model.proj_out.register_forward_hook(lambda m, a, out: state.gather(out, 1, state.total)).remove)
    for block in model.blocks:
        _kind_hooks(stack, block.attn1, lambda: ("self", 0, state.total))
        _kind_hooks(stack, block.attn2, lambda: ("cross", 0, None))


def _unet(stack, model, state: _Split) -> None:
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, BasicTransformerBlock)]
    for block in blocks:
        lengths = []

        def split_tokens(mod, args, kwargs, lengths=lengths):
            hidden = _first_arg(args, kwargs, "hidden_states")
            lengths.append(hidden.shape[1])
            return _replace_first(args, kwargs, "hidden_states", state.shard(hidden, 1))

        def gather_tokens(mod, args, kwargs, out, lengths=lengths):
            return state.gather(out, 1, lengths.pop())

        stack.callback(block.register_forward_pre_hook(split_tokens, with_kwargs=True).remove)
        stack.callback(block.register_forward_hook(gather_tokens, with_kwargs=True).remove)
        self_kind = "cross" if getattr(block, "only_cross_attention", False) else "self"
        _kind_hooks(stack, block.attn1, lambda lengths=lengths, k=self_kind: (k, 0, lengths[-1] if k == "self" else None))
        if getattr(block, "attn2", None) is not None:
            _kind_hooks(stack, block.attn2, lambda: ("cross", 0, None))


_PLANS = {"FluxTransformer2DModel": _flux, "WanTransformer3DModel": _wan, "UNet2DConditionModel": _unet}


def split(stack: contextlib.ExitStack, models: list, par) -> None:
    """Install the split of every denoiser among ``models`` ((model, role) pairs) until ``stack`` closes;
    ValueError for a denoiser whose split is not known."""
    if not isinstance(par, _parallel.Parallel):
        raise ValueError(f"parallel must be a lib_attn.parallel.Parallel, got {type(par).__name__}")
    denoisers = [model for model, role in models if role in ("unet", "dit")]
    if not denoisers:
        raise ValueError("route(parallel=...): no denoiser (unet or transformer) to split")
    for model in denoisers:
        plan = _PLANS.get(type(model).__name__)
        if plan is None:
            raise ValueError(f"route(parallel=...): no known sequence split for {type(model).__name__}; the known "
                             f"ones: {', '.join(KNOWN)}")
        plan(stack, model, _Split(par))
    stack.enter_context(_parallel.use(par))
    stack.enter_context(_opened())


@contextlib.contextmanager
def _opened():
    global _open
    _open += 1
    try:
        yield
    finally:
        _open -= 1
