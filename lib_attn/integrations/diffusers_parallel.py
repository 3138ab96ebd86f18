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


def _kind_hooks(stack: contextlib.ExitStack, module, kind_of, name: str, adopt) -> None:
    """Say the kind of the attention calls ``module`` makes (``kind_of()`` -> (kind, text_len, seq_len))
    for the length of its forward, an exception included. A processor set on it after the split opened
    (set_attn_processor, attention slicing, a PAG pipeline's own processors) is handed to
    ``adopt(name, module, kind)`` first: routed so that the split reaches it, or refused."""
    tokens = []

    def enter(mod, args):
        found = kind_of()
        if not _is_routed(mod.processor):
            adopt(name, mod, found[0])
        tokens.append(_call.set(found))

    def leave(mod, args, out):
        if tokens:
            _call.reset(tokens.pop())

    stack.callback(module.register_forward_pre_hook(enter).remove)
    stack.callback(module.register_forward_hook(leave, always_call=True).remove)


def _is_routed(processor) -> bool:
    return "_lib_attn_role" in type(processor).__dict__


def _first_arg(args, kwargs, name: str):
    return kwargs[name] if name in kwargs else (args[0] if args else None)


def _replace_first(args, kwargs, name: str, value):
    if name in kwargs:
        return args, {**kwargs, name: value}
    return (value, *args[1:]), kwargs


def _flux(stack, model, state: _Split, adopt) -> None:
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
            _kind_hooks(stack, module, lambda: ("joint", state.text_len, state.total), name, adopt)


def _wan(stack, model, state: _Split, adopt) -> None:
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
    for i, block in enumerate(model.blocks):
        _kind_hooks(stack, block.attn1, lambda: ("self", 0, state.total), f"blocks.{i}.attn1", adopt)
        _kind_hooks(stack, block.attn2, lambda: ("cross", 0, None), f"blocks.{i}.attn2", adopt)


def _unet(stack, model, state: _Split, adopt) -> None:
    from diffusers.models.attention import BasicTransformerBlock

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, BasicTransformerBlock)]
    for block_name, block in blocks:
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
        _kind_hooks(stack, block.attn1, lambda lengths=lengths, k=self_kind: (k, 0, lengths[-1] if k == "self" else None),
                    f"{block_name}.attn1", adopt)
        if getattr(block, "attn2", None) is not None:
            _kind_hooks(stack, block.attn2, lambda: ("cross", 0, None), f"{block_name}.attn2", adopt)
            stack.callback(block.attn2.register_forward_pre_hook(_refuse_ip_masks, with_kwargs=True).remove)


def _refuse_ip_masks(module, args, kwargs):
    # An IP-Adapter's masks are scaled to the call's query tokens as if they were the whole image: on a
    # rank's share they would land on other tokens. Every rank gets the same arguments: all refuse alike.
    if kwargs.get("ip_adapter_masks") is not None and "IPAdapter" in type(module.processor).__name__:
        raise ValueError("route(parallel=...): IP-Adapter masks (cross_attention_kwargs ip_adapter_masks) cannot be "
                         "split: they are scaled to one rank's share of the tokens as if it were the whole image; "
                         "run without masks or without parallel=")


_PLANS = {"FluxTransformer2DModel": _flux, "WanTransformer3DModel": _wan, "UNet2DConditionModel": _unet}


# --- what route(parallel=) refuses before anything runs -----------------------------------------------

def _sharded(model) -> list:
    """(name, attention module, whether its calls get a kind) for every module holding a processor that
    runs on this rank's share of the tokens: those whose attention must be split."""
    kind = type(model).__name__
    found = []
    if kind == "FluxTransformer2DModel":
        return [(name, m, True) for name, m in model.named_modules() if name and hasattr(m, "processor")]
    if kind == "WanTransformer3DModel":
        scopes = [(f"blocks.{i}", block, (block.attn1, block.attn2)) for i, block in enumerate(model.blocks)]
    else:
        from diffusers.models.attention import BasicTransformerBlock

        scopes = [(name, block, (block.attn1, getattr(block, "attn2", None)))
                  for name, block in model.named_modules() if isinstance(block, BasicTransformerBlock)]
    for prefix, block, kinded in scopes:
        for name, m in block.named_modules():
            if hasattr(m, "processor"):
                found.append((f"{prefix}.{name}" if name else prefix, m, any(m is k for k in kinded)))
    return found


#: Processors that compute the attention ``AttnProcessor2_0`` computes, with matmuls instead of SDPA
#: (diffusers' default without SDPA, and ``enable_attention_slicing``'s): split as that one.
SAME_AS_SDPA = ("AttnProcessor", "SlicedAttnProcessor")

#: diffusers hooks that cannot run on one rank's share of the tokens, by class, and why.
REFUSED_HOOKS = {
    "FBCHeadBlockHook": "First Block Cache decides from this rank's share of the tokens whether to skip the "
                        "remaining blocks: the ranks would decide apart and wait on each other",
    "FBCBlockHook": "First Block Cache decides from this rank's share of the tokens whether to skip the "
                    "remaining blocks: the ranks would decide apart and wait on each other",
    "SmoothedEnergyGuidanceHook": "smoothed energy guidance blurs the queries over the image's rows and "
                                  "columns, which one rank's share does not hold",
    "ContextParallelSplitHook": "diffusers' own context parallelism splits the same sequence a second time",
    "ContextParallelGatherHook": "diffusers' own context parallelism splits the same sequence a second time",
}


#: What a layer-skipping guider's hook that skips attention scores (PerturbedAttentionGuidance, or
#: SkipLayerGuidance / AutoGuidance with skip_attention_scores) cannot do under route().
SKIPS_SCORES = ("it skips attention scores (PerturbedAttentionGuidance, or a layer skip with "
                "skip_attention_scores=True) by catching F.scaled_dot_product_attention as it is called, which a "
                "processor routed through lib_attn does not call; use SkipLayerGuidance with skip_attention=True "
                "instead, or run the guider outside route()")


def hook_problems(model, split: bool, modules=None) -> list:
    """[why a diffusers hook on ``model`` cannot run, one line each]: those that cannot run on one rank's
    share of the tokens (``split``) and those that skip attention scores. Cheap enough to run at every
    denoiser call: a guider or a cache may add its hooks after route() opened (SmoothedEnergyGuidance
    and the layer-skipping guiders do, at each step). ``modules``: ``model``'s modules, listed once
    (walking the tree again costs ten times as much)."""
    problems = []
    for module in model.modules() if modules is None else modules:
        registry = module.__dict__.get("_diffusers_hook")  # not getattr: nn.Module's miss path is slow
        hooks = getattr(registry, "hooks", None)
        if not hooks:
            continue
        for hook_name, hook in hooks.items():
            cls = type(hook).__name__
            why = REFUSED_HOOKS.get(cls) if split else None
            if cls == "AttentionProcessorSkipHook" and getattr(hook, "skip_attention_scores", False):
                why = SKIPS_SCORES
            if why:
                name = next((n for n, m in model.named_modules() if m is module), "")
                problems.append(f"hook {hook_name!r} ({cls}) on {name or 'the model'}: {why}")
    return problems


def refuse_hooks(stack: contextlib.ExitStack, model, split: bool) -> None:
    """Until ``stack`` closes, check ``model``'s diffusers hooks as each call begins (``hook_problems``),
    before any rank splits or exchanges anything: every rank holds the same hooks, so every rank raises
    the same ValueError instead of one deciding alone from its share (a wrong image, or a stall)."""
    modules = list(model.modules())  # hooks go on modules the model has: those of the scope's start

    def check(mod, args):
        problems = hook_problems(mod, split, modules)
        if problems:
            raise ValueError(f"lib_attn route({'parallel=...' if split else ''}) cannot run {type(mod).__name__} "
                             f"with these diffusers hooks (added after route() opened):\n  " + "\n  ".join(problems))

    stack.callback(model.register_forward_pre_hook(check).remove)


def substitutable(module) -> str:
    """'' when ``module``'s attention is the one ``AttnProcessor2_0`` computes (so a processor of
    ``SAME_AS_SDPA`` may be split as that one), else what differs."""
    processor = module.processor
    if getattr(module, "norm_q", None) is not None or getattr(module, "norm_k", None) is not None:
        return "it has query/key norms, which " + type(processor).__name__ + " does not apply"
    heads, inner = getattr(module, "heads", None), getattr(module, "inner_dim", None)
    if not heads or not inner or abs(module.scale - (inner // heads) ** -0.5) > 1e-12:
        return f"its scale {getattr(module, 'scale', None)} is not 1/sqrt(head size)"
    if type(processor).__name__ == "SlicedAttnProcessor" and getattr(module, "spatial_norm", None) is not None:
        return "it has a spatial norm, which SlicedAttnProcessor does not apply"
    return ""


def second_call(name: str, cls: str) -> str:
    """Why processor class ``cls`` on the module ``name`` cannot be split ('' when it can): an IP-Adapter
    processor off a cross-attention module makes a second call, attending this rank's queries to the
    adapter's image tokens: a call of another kind than its module's, which the split cannot tell apart."""
    if "IPAdapter" in cls and name.split(".")[-1] != "attn2":
        return (f"{cls} (IP-Adapter) makes a second attention call to the adapter's image tokens that cannot be "
                f"split; unload the IP-Adapter to split this model")
    return ""


def differs_somewhere(modules, processor) -> str:
    """'' when ``processor`` (one object may serve many modules) computes ``AttnProcessor2_0``'s attention on
    every one of ``modules`` it serves (``substitutable``), else what differs on the first that does not."""
    users = [m for m in modules if getattr(m, "processor", None) is processor]
    return next((w for w in map(substitutable, users) if w), "")


def same_as_sdpa(models: list, kind_of) -> tuple[dict, dict]:
    """({id(processor): True} for the processors of ``SAME_AS_SDPA`` in ``models`` that may run as
    ``AttnProcessor2_0`` on every module they serve (``set_default_attn_processor`` installs one shared
    ``AttnProcessor``), {class name: what differs} for those that may not). ``kind_of`` as in
    ``plan_refusals``."""
    as_sdpa, differ = {}, {}
    for model, _ in models:
        modules = list(model.modules())
        for module in modules:
            processor = getattr(module, "processor", None)
            cls = type(processor).__name__
            if processor is None or id(processor) in as_sdpa or cls not in SAME_AS_SDPA or kind_of(processor):
                continue
            why = differs_somewhere(modules, processor)
            if why:
                differ[cls] = why
            else:
                as_sdpa[id(processor)] = True
    return as_sdpa, differ


def plan_refusals(models: list, kind_of) -> tuple[dict, list]:
    """({id(processor): True} for the processors of ``SAME_AS_SDPA`` to split as ``AttnProcessor2_0``,
    [why route(parallel=) cannot split a denoiser, one line each]). ``kind_of(processor)``: how a
    processor reaches attention (None: neither SDPA nor diffusers' dispatcher)."""
    as_sdpa, problems, unsplit = {}, [], {}
    for model, role in models:
        if role not in ("unet", "dit") or type(model).__name__ not in _PLANS:
            continue
        problems += hook_problems(model, split=True)
        for name, module in model.named_modules():
            if getattr(module, "pos_embed", None) is not None and type(module).__name__ == "BasicTransformerBlock":
                # It numbers the tokens it is given from 0, not from where the rank's share starts.
                problems.append(f"{name}: a positional embedding inside the transformer block cannot be split")
        for name, module, kinded in _sharded(model):
            processor = module.processor
            cls = type(processor).__name__
            if not kinded:
                unsplit.setdefault((cls, "the split does not know which kind of call it makes"), []).append(name)
            elif second_call(name, cls):
                problems.append(f"{name}: {second_call(name, cls)}")
            elif kind_of(processor) is None and name.split(".")[-1] == "attn2":
                pass  # cross-attention: every rank holds every key, so any processor is exact on a share
            elif kind_of(processor) is None:
                why = substitutable(module) if cls in SAME_AS_SDPA else "it reaches attention neither through " \
                    "F.scaled_dot_product_attention nor through diffusers' attention dispatcher"
                if why:
                    unsplit.setdefault((cls, why), []).append(name)
                else:
                    as_sdpa[id(processor)] = True
        for name, module in model.named_modules():  # a shared processor object serves modules outside too
            if id(getattr(module, "processor", None)) in as_sdpa and substitutable(module):
                unsplit.setdefault((type(module.processor).__name__, substitutable(module)), []).append(name)
    for (cls, why), names in unsplit.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        problems.append(f"{len(names)} attention module(s) with {cls} would attend to one rank's share of the "
                        f"tokens only ({why}): {shown}")
    return as_sdpa, problems


def _adopter(model, kind_of, route_as):
    """The function that takes a processor found unrouted on a split module of ``model`` as it is called
    (set after route(parallel=) opened): ``route_as(processor, kind)`` it as route() would have, or
    raise ValueError naming the module and the processor. It reads the module and its processor only,
    so every rank decides the same."""
    left_alone: dict = {}  # id -> processor: cross-attention processors the split need not reach

    def adopt(name: str, module, call_kind: str) -> None:
        processor = module.processor
        if id(processor) in left_alone:
            return
        kind, cls, why = kind_of(processor), type(processor).__name__, ""
        if second_call(name, cls):  # as route() refuses it when it is there before the scope opens
            raise ValueError(f"route(parallel=...): {name} was given {cls} after the split opened: "
                             f"{second_call(name, cls)}")
        if kind is None and cls in SAME_AS_SDPA:
            why = differs_somewhere(model.modules(), processor)
            if not why:
                return route_as(processor, None)
        if kind is not None:
            return route_as(processor, kind)
        if call_kind == "cross":  # every rank holds every key of a cross call: exact on a share as it is
            left_alone[id(processor)] = processor
            return
        why = why or "it reaches attention neither through F.scaled_dot_product_attention nor through diffusers' " \
            "attention dispatcher"
        raise ValueError(f"route(parallel=...): {name} was given {cls} after the split opened, which would attend "
                         f"to one rank's share of the tokens only ({why}); set the model's processors before "
                         f"route() opens, or use processors that the split reaches")

    return adopt


def split(stack: contextlib.ExitStack, models: list, par, kind_of, router) -> None:
    """Install the split of every denoiser among ``models`` ((model, role) pairs) until ``stack`` closes;
    ValueError for a denoiser whose split is not known. ``kind_of`` as for ``plan_refusals``;
    ``router(role)`` gives the ``route_as`` of ``_adopter`` for a model of that role."""
    if not isinstance(par, _parallel.Parallel):
        raise ValueError(f"parallel must be a lib_attn.parallel.Parallel, got {type(par).__name__}")
    denoisers = [model for model, role in models if role in ("unet", "dit")]
    if not denoisers:
        raise ValueError("route(parallel=...): no denoiser (unet or transformer) to split")
    for model in denoisers:
        if type(model).__name__ not in _PLANS:
            raise ValueError(f"route(parallel=...): no known sequence split for {type(model).__name__}; the known "
                             f"ones: {', '.join(KNOWN)}")
    for model, role in models:
        if role in ("unet", "dit"):
            refuse_hooks(stack, model, split=True)  # first: before the split's own pre-hooks
            _PLANS[type(model).__name__](stack, model, _Split(par), _adopter(model, kind_of, router(role)))
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
