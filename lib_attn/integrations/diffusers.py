"""Route a diffusers model's (or pipeline's) attention through the engine, for one ``with`` block.

    from lib_attn.integrations.diffusers import route
    with route(pipe):                    # pipe.unet / pipe.transformer and pipe.vae; text encoders stay
        image = pipe(prompt).images[0]

diffusers reaches attention two ways, and ``route`` takes both without changing diffusers' code:

- Processors that call ``F.scaled_dot_product_attention`` (``AttnProcessor2_0`` in UNets and VAEs,
  ``JointAttnProcessor2_0`` in SD3): each routed processor object is moved, for the scope, to a
  subclass whose ``__call__`` is the class's own function object rebuilt over a copy of its module
  globals in which ``F`` is ``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced.
  The code and signature are diffusers' own (``Attention.forward`` filters keyword arguments by
  that signature); only the one name resolves differently.
- Processors that call ``dispatch_attention_fn`` (Flux and most newer transformers): the engine is a
  string-keyed entry of diffusers' attention backend registry, registered and made the active backend
  only inside the scope. Routed processors reach it with their role; any other model calling the
  dispatcher meanwhile is served by the backend that was active before. This registry is private
  diffusers API: ``route`` checks it and refuses a diffusers it does not know (see SUPPORTED).

Calls the engine does not serve (dropout, causal, grouped-query, returning the log-sum-exp, context
parallel) run unchanged on PyTorch's SDPA (on the dispatcher, on the backend that was active before),
and are counted in the recording's fallbacks as ``(role, "lib_attn", reason)``; under torch.compile
they are traced as PyTorch's own call and not counted. On exit every processor gets its own class
back and the registry is as it was.

With a schedule (``route(pipe, schedule="0-50%: sdpa; 50-100%: math")``, or one configured before
the scope), the scope tells the engine where sampling is: a forward pre-hook on the pipeline's
denoiser reads the step from the pipeline's scheduler as each model call starts (``Sampling``), and
``lib_attn.schedule.blocks`` numbers the denoiser's blocks. Nothing in the user's call changes and
the step callback stays the user's. A compiled denoiser still gets its step (the hook runs before
the compiled call), but not its blocks: their hooks run inside the compiled graph.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import types

import torch
import torch.nn.functional as F

from .. import _compat, stats
from .. import schedule as _schedule
from .. import scope as _scope
from ..config import checked_sparse as _checked_sparse
from ..config import current as _current_config
from ..config import use as _use_config
from ..dispatch import attention
from . import diffusers_device as _where, diffusers_parallel as _split, diffusers_text as _joint_text

log = logging.getLogger("lib_attn")

#: diffusers versions whose dispatcher registry ``route`` was written against and tested with
#: (from, before). The SDPA-processor path needs no private API and works on older diffusers too.
SUPPORTED = ((0, 35), (0, 43))
REGISTRY_KEY = "lib_attn"
ROLE_ARG = "_lib_attn_role"
PASSED_OVER = "lib_attn"


def _unserved(q_heads: int, k_heads: int, dropout_p, is_causal, enable_gqa, return_lse=False, parallel=None) -> str:
    """Why the engine does not take a call, or '' when it does."""
    if dropout_p:
        return "dropout"
    if is_causal:
        return "causal mask"
    if enable_gqa or q_heads != k_heads:
        return "grouped-query heads"
    if return_lse:
        return "log-sum-exp requested"
    if parallel is not None:
        return "context parallel"
    return ""


def _count_unserved(role: str, reason: str, ran_on: str) -> None:
    if not _compat.IS_COMPILING():
        stats.count("fallbacks", (role, PASSED_OVER, f"{reason}: ran on {ran_on}"), 1, _scope.current().recordings)


# --- the stand-ins served by the engine -----------------------------------------------------------
#
# Each takes ``role``: a role, or a function of no arguments that gives the role of the call being made
# (a host that routes by what runs now); a role of None runs the call exactly as it was made, on
# PyTorch's SDPA or diffusers' dispatcher, and does not count it.

def served_sdpa(role):
    """A stand-in for ``F.scaled_dot_product_attention`` whose calls the engine serves for ``role``."""
    role_now = role if callable(role) else None

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        call_role = role if role_now is None else role_now()
        if call_role is not None:
            reason = "not 4-D" if query.dim() != 4 or key.dim() != 4 else _unserved(
                query.shape[1], key.shape[1], dropout_p, is_causal, enable_gqa)
            if not reason:
                return _split.attend(query, key, value, "bhsd", attn_mask, scale, call_role, attention)
            _count_unserved(call_role, reason, "PyTorch SDPA")
        extra = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **extra)

    return scaled_dot_product_attention


def served_functional(role) -> types.ModuleType:
    """``torch.nn.functional`` with its SDPA served by the engine for ``role`` (everything else is
    PyTorch's own)."""
    module = types.ModuleType(f"lib_attn.functional.{role if isinstance(role, str) else 'routed'}")
    module.__dict__.update({k: v for k, v in vars(F).items() if not k.startswith("__")})
    module.scaled_dot_product_attention = served_sdpa(role)
    return module


def _engine_bshd(query, key, value, attn_mask, scale, role):
    """A dispatcher call, (batch, seq, heads, head_dim), on the engine."""
    if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        # The dispatcher's (batch, keys) mask; the engine's masks broadcast like SDPA's.
        attn_mask = attn_mask[:, None, None, :]
    return _split.attend(query, key, value, "bshd", attn_mask, scale, role, attention)


def _dispatch_reason(query, key, dropout_p, is_causal, enable_gqa, return_lse=False, parallel=None) -> str:
    if query.dim() != 4 or key.dim() != 4:
        return "not 4-D"
    return _unserved(query.shape[2], key.shape[2], dropout_p, is_causal, enable_gqa, return_lse, parallel)


def served_dispatch(role, dispatch_attention_fn):
    """A stand-in for diffusers' ``dispatch_attention_fn`` (the real one, given) whose calls the engine
    serves for ``role``; a call it does not take goes on to the real one, as made, counted with its
    reason. A backend the model chose (``backend=``) is not asked for the calls the engine serves."""
    role_now = role if callable(role) else None

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, **rest):
        call_role = role if role_now is None else role_now()
        if call_role is not None:
            parallel = rest.get("parallel_config", rest.get("_parallel_config"))
            reason = _dispatch_reason(query, key, dropout_p, is_causal, enable_gqa, parallel=parallel)
            if not reason and attention_kwargs:
                reason = f"backend arguments {', '.join(sorted(attention_kwargs))}"
            if not reason:
                return _engine_bshd(query, key, value, attn_mask, scale, call_role)
            _count_unserved(call_role, reason, "diffusers' dispatcher")
        return dispatch_attention_fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     attention_kwargs, **rest)

    return dispatch


# --- processors that call dispatch_attention_fn ---------------------------------------------------

def _dispatch_for(role: str, dispatch_attention_fn):
    """A stand-in for diffusers' ``dispatch_attention_fn`` that sends the call through the real one to
    the engine's registry entry, with the role as an extra keyword the entry declares."""
    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, *, backend=None, **rest):
        extra = dict(attention_kwargs or {})
        extra[ROLE_ARG] = role
        # backend=None: the active backend, which inside the scope is the engine's entry, even for a
        # model that chose a backend with set_attention_backend.
        return dispatch_attention_fn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     extra, backend=None, **rest)
    return dispatch


class _Registry:
    """The engine's entry in diffusers' backend registry, active while any route scope is open."""

    def __init__(self):
        self.depth = 0
        self.registry = None
        self.warned = False
        self.saved = None  # (active backend, {table: previous entry under REGISTRY_KEY})
        self.previous = None  # (name, function): serves unrouted and unserved calls

    def enter(self, registry) -> None:
        if self.depth == 0:
            self.registry = registry
            tables = (registry._backends, registry._constraints, registry._supported_arg_names)
            self.saved = (registry._active_backend, [(t, t.get(REGISTRY_KEY, _MISSING)) for t in tables])
            active = registry._active_backend
            self.previous = (active, registry._backends[active])
            registry._backends[REGISTRY_KEY] = self.backend
            registry._constraints[REGISTRY_KEY] = []
            registry._supported_arg_names[REGISTRY_KEY] = set(inspect.signature(self.backend).parameters)
            registry._active_backend = REGISTRY_KEY
        self.depth += 1

    def exit(self, registry) -> None:
        self.depth -= 1
        if self.depth == 0:
            active, tables = self.saved
            for table, entry in tables:
                if entry is _MISSING:
                    table.pop(REGISTRY_KEY, None)
                else:
                    table[REGISTRY_KEY] = entry
            registry._active_backend = active
            self.saved = self.previous = self.registry = None

    def backend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False, _parallel_config=None, _lib_attn_role=None):
        """q, k, v: (batch, seq, heads, head_dim), as the dispatcher passes them."""
        role = _lib_attn_role
        if role is None:  # a model that is not routed: served as before the scope
            return self.serve_as_before(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        return_lse, _parallel_config)
        reason = _dispatch_reason(query, key, dropout_p, is_causal, enable_gqa, return_lse, _parallel_config)
        if reason:
            name = self.previous[0]
            _count_unserved(role, reason, f"diffusers' {getattr(name, 'value', name)} backend")
            return self.serve_as_before(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        return_lse, _parallel_config)
        return _engine_bshd(query, key, value, attn_mask, scale, role)

    def serve_as_before(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                        _parallel_config):
        """The call on the backend that was active before the scope, given the arguments it declares."""
        name, fn = self.previous
        args = dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                    _parallel_config=_parallel_config)
        accepted = self.registry._supported_arg_names[name]
        return fn(**{k: v for k, v in args.items() if k in accepted})


_MISSING = object()
_REGISTRY = _Registry()


def _dispatcher_registry():
    """diffusers' attention backend registry, checked; RuntimeError says plainly when it is unknown."""
    import diffusers
    from diffusers.models import attention_dispatch

    version = _compat._version(diffusers.__version__)
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    missing = [a for a in ("_backends", "_constraints", "_supported_arg_names", "_active_backend")
               if not hasattr(registry, a)]
    since, before = (".".join(map(str, v)) for v in SUPPORTED)
    if version < SUPPORTED[0] or missing:
        raise RuntimeError(
            f"lib_attn cannot route attention dispatcher models on diffusers {diffusers.__version__}: its "
            f"backend registry is not the one route() knows (diffusers {since} up to {before} "
            f"excluded){'; missing ' + ', '.join(missing) if missing else ''}")
    if version >= SUPPORTED[1] and not _REGISTRY.warned:
        _REGISTRY.warned = True
        log.warning("lib_attn: diffusers %s is newer than the versions route() was tested with "
                    "(before %s); routing its dispatcher anyway", diffusers.__version__, before)
    return registry


# --- processors ---------------------------------------------------------------------------------

SDPA, DISPATCHER = "sdpa", "dispatcher"
_routed_classes: dict = {}  # (processor class, role) -> its routed subclass


def processor_kind(processor) -> str | None:
    """How a processor reaches attention, read from its ``__call__``'s code: SDPA, DISPATCHER or None."""
    call = getattr(type(processor), "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None:
        return None
    names = code.co_names
    if "dispatch_attention_fn" in names and call.__globals__.get("dispatch_attention_fn") is not None:
        return DISPATCHER
    if "scaled_dot_product_attention" in names and call.__globals__.get("F") is F:
        return SDPA
    return None


def _routed_class(cls, kind: str, role: str):
    found = _routed_classes.get((cls, role))
    if found is None:
        call = cls.__call__
        # A copy without ``__name__``: torch.compile then reads these globals as their own scope
        # instead of looking each name up again on diffusers' module.
        names = {k: v for k, v in call.__globals__.items() if k != "__name__"}
        if kind == SDPA:
            names["F"] = served_functional(role)
        else:
            names["dispatch_attention_fn"] = _dispatch_for(role, names["dispatch_attention_fn"])
        routed_call = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
        routed_call.__kwdefaults__ = call.__kwdefaults__
        routed_call.__qualname__ = call.__qualname__
        routed_call.__module__ = call.__module__
        routed_call.__doc__ = call.__doc__
        found = type(cls.__name__, (cls,), {"__call__": routed_call, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__, "_lib_attn_role": role})
        _routed_classes[(cls, role)] = found
        _register_for_layer_skip(cls, found)
    return found


def _register_for_layer_skip(cls, routed) -> None:
    """Give ``routed`` its base class's entry in diffusers' attention processor registry, which the
    layer-skipping guiders (SkipLayerGuidance, AutoGuidance) look the processor's exact class up in."""
    try:
        from diffusers.hooks._helpers import AttentionProcessorRegistry

        AttentionProcessorRegistry.register(routed, AttentionProcessorRegistry.get(cls))
    except (ImportError, ValueError):  # no layer skipping (before 0.35), or the base class is not known
        pass


def _sdpa_processor():
    """diffusers' ``AttnProcessor2_0``: the code a processor of ``SAME_AS_SDPA`` runs while split (the
    same attention, through SDPA, which the split reaches)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    return AttnProcessor2_0


def is_routed(processor) -> bool:
    return "_lib_attn_role" in type(processor).__dict__


# --- which models, which roles --------------------------------------------------------------------

_DENOISER_NAMES = ("unet", "transformer", "prior", "decoder")


def role_of(name: str, model) -> str | None:
    """The role of a pipeline component (None: not routed, e.g. text encoders), or of a model."""
    cls = type(model).__name__.lower()
    name = name.lower()
    if "text" in name or "image_encoder" in name or "tokenizer" in name:
        return None
    if "vae" in name or name in ("movq", "vqvae") or cls.startswith(("autoencoder", "vqmodel")):
        return "vae"
    if "unet" in name or "unet" in cls:
        return "unet"
    if any(n in name for n in _DENOISER_NAMES) or "transformer" in cls:
        return "dit"
    return None


def _models(model_or_pipeline, role: str | None) -> list:
    """(model, role) for every model ``route`` covers."""
    if isinstance(model_or_pipeline, torch.nn.Module):
        found = role or role_of("", model_or_pipeline) or "dit"
        return [(model_or_pipeline, found)]
    components = getattr(model_or_pipeline, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"route() takes a torch.nn.Module or a diffusers pipeline, got {type(model_or_pipeline).__name__}")
    out = []
    for name, part in components.items():
        if isinstance(part, torch.nn.Module):
            found = role_of(name, part)
            if found is not None:
                out.append((part, role or found))
    return out


# --- where a pipeline's sampling is -------------------------------------------------------------

class Sampling:
    """A forward pre-hook for a pipeline's denoiser that tells the schedule the step as each model
    call starts, read from the pipeline's scheduler (one Python call per model call).

    A pass starts when the scheduler's ``timesteps`` is a new tensor (``set_timesteps`` at the start of
    every pipeline call). The position in ``timesteps`` is the scheduler's own ``step_index`` (set by
    ``scale_model_input`` or after its first ``step``; before that its ``begin_index``), PNDM's
    ``counter`` from the pass's first position, or else the position of the denoiser's ``timestep``
    argument in ``timesteps`` (DDIM, DDPM). The pass's first position is its first model call's:
    img2img's strength starts it part-way, and the steps of the pass are the ones that run. A
    scheduler of order 2 (Heun, KDPM2, DPM-Solver SDE) runs two model calls per step; both count as
    that step. The sigma is the scheduler's ``sigmas`` at the step's first call, or, for schedulers
    without sigmas, ``sqrt((1 - alpha_bar) / alpha_bar)`` at the step's timestep: the same scale.
    """

    def __init__(self, scheduler, pass_name: str | None = None):
        self.scheduler = scheduler
        self.pass_name = pass_name
        self.timesteps = None  # the scheduler's timesteps tensor of the pass in progress
        self.values: list = []
        self.sigmas: list = []
        self.begin: int | None = None

    def __call__(self, module, args, kwargs):
        timesteps = getattr(self.scheduler, "timesteps", None)
        if timesteps is None:
            return
        if timesteps is not self.timesteps:
            self._start(timesteps)
        index = self._index(kwargs["timestep"] if "timestep" in kwargs else args[1] if len(args) > 1 else None)
        if self.begin is None:
            self.begin = index
        if index is None or self.begin is None or not self.begin <= index < len(self.values):
            _schedule.at_step(None, None, pass_name=self.pass_name)
            return
        order = max(int(getattr(self.scheduler, "order", 1) or 1), 1)
        step = (index - self.begin) // order
        first = self.begin + step * order
        _schedule.at_step(step, -(-(len(self.values) - self.begin) // order),
                          self.sigmas[first] if first < len(self.sigmas) else None, self.pass_name)

    def _start(self, timesteps) -> None:
        self.timesteps = timesteps
        self.values = [float(t) for t in timesteps.tolist()] if torch.is_tensor(timesteps) else list(map(float, timesteps))
        self.begin = None
        sigmas = getattr(self.scheduler, "sigmas", None)
        alphas = getattr(self.scheduler, "alphas_cumprod", None)
        if torch.is_tensor(sigmas) and sigmas.dim() == 1:
            self.sigmas = sigmas.tolist()
        elif torch.is_tensor(alphas) and alphas.dim() == 1:
            bars = alphas.tolist()
            self.sigmas = [_schedule.sigma_of_alpha_bar(bars[i]) if 0 <= (i := round(t)) < len(bars) else None
                           for t in self.values]
        else:
            self.sigmas = []

    def _index(self, timestep) -> int | None:
        scheduler = self.scheduler
        if hasattr(type(scheduler), "step_index"):
            index = scheduler.step_index
            if index is None:  # before the scheduler's first step of the pass
                index = getattr(scheduler, "begin_index", None)
            if index is None:
                index = self.begin
            if index is not None:
                return index
        elif self.begin is not None and isinstance(getattr(scheduler, "counter", None), int):
            return self.begin + scheduler.counter
        return self._position(timestep)

    def _position(self, timestep) -> int | None:
        """The position of ``timestep`` in the pass's timesteps, from the pass's first position on: the
        nearest value within 0.5, as a timestep cast to the model's dtype may be rounded."""
        if timestep is None:
            return None
        value = float(timestep.reshape(-1)[0]) if torch.is_tensor(timestep) else float(timestep)
        start = self.begin or 0
        best = min(range(start, len(self.values)), key=lambda i: abs(self.values[i] - value), default=None)
        return best if best is not None and abs(self.values[best] - value) <= 0.5 else None


class Routing:
    """What a ``route`` scope covers: ``processors`` {role: number routed}, ``skipped`` {processor
    class name: number} for processors that reach attention some other way (left unchanged)."""

    def __init__(self):
        self.processors: dict = {}
        self.skipped: dict = {}
        self._swapped: list = []  # (processor, its own class)
        self._registry = None

    def __repr__(self):
        return f"Routing(processors={self.processors}, skipped={self.skipped})"


@contextlib.contextmanager
def route(model_or_pipeline, role: str | None = None, schedule=None, pass_name: str | None = None, parallel=None,
          sparse=None):
    """Route every attention call of a diffusers model or pipeline through ``lib_attn`` in the scope.

    A pipeline routes its denoiser (``unet`` as role "unet"; ``transformer``, ``prior``, ``decoder`` as
    "dit") and its VAE ("vae"), never its text or image encoders; ``role`` (unet, dit, vae, text)
    overrides the role of every model routed. Yields a ``Routing``. Use ``lib_attn.recording()`` to see
    what ran. Raises RuntimeError when a model calls diffusers' attention dispatcher and the installed
    diffusers' registry is not one ``route`` knows (see ``SUPPORTED``).

    ``schedule`` (text or a ``lib_attn.schedule.Schedule``) is put in force for the scope; a bad one
    raises ``ScheduleError`` before anything changes. While a schedule is in force at entry (this one
    or one configured before), the scope tells it the step of a pipeline's sampling (``Sampling``) and
    the denoiser's block (``lib_attn.schedule.blocks``); ``pass_name`` (base, hires, refiner) names the
    pass the pipeline's steps belong to, e.g. "refiner" for an SDXL refiner pipeline.

    ``sparse`` (sparse settings as ``lib_attn.configure(sparse=...)`` takes them: text, a dict, True, a
    ``lib_attn.Sparse``, or "off") is put in force for the scope; bad ones, or a method that cannot run on
    the models' device, raise ``SparseError`` first. Its dense windows, like a schedule, make the scope
    tell the step and the block; joint models' blocks tell their text tokens (``diffusers_text``).

    ``parallel`` (a ``lib_attn.parallel.Parallel``, every rank running the same pipeline) splits the
    denoiser's sequence over the ranks and puts the configuration in force for the scope
    (``diffusers_parallel``); a denoiser whose split is not known, an attention module on a rank's share
    that the split cannot reach, or a hook that cannot run on a share raises ValueError naming them,
    before anything changes. ``AttnProcessor`` and ``SlicedAttnProcessor`` (``set_default_attn_processor``'s,
    ``enable_attention_slicing``'s) run ``AttnProcessor2_0``'s code for the scope where every module they serve
    computes the same attention; what is left as it is, and a model with no attention, get a log warning.
    """
    from ..spec import ROLES

    if role is not None and role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if pass_name is not None and pass_name not in _schedule.PASSES:
        raise ValueError(f"pass {pass_name!r} is not one of {', '.join(_schedule.PASSES)}")
    models = _models(model_or_pipeline, role)
    if sparse is not None:  # refused where its method cannot run on the device the models run on
        sparse = _checked_sparse(sparse, _where.run_device(model_or_pipeline, models)) or "off"
    routing = Routing()
    plan, seen = [], set()
    as_sdpa, differ = _split.same_as_sdpa(models, processor_kind) if parallel is None else ({}, {})
    if parallel is not None:
        # Split attention that the split cannot reach would attend to one rank's share of the tokens
        # as if it were the whole sequence: a wrong image on every rank, and no error.
        as_sdpa, problems = _split.plan_refusals(models, processor_kind)
        if problems:
            raise ValueError("route(parallel=...) cannot split this model:\n  " + "\n  ".join(problems) +
                             "\nSplit models need processors that call F.scaled_dot_product_attention or diffusers' "
                             "attention dispatcher (diffusers' defaults, e.g. model.set_attn_processor(AttnProcessor2_0())"
                             " on a UNet, AttnProcessor and SlicedAttnProcessor too) and none of the hooks named.")
    for model, model_role in models:
        for module in model.modules():
            processor = getattr(module, "processor", None)
            # One processor object may serve many modules (set_attn_processor with one instance).
            if processor is None or is_routed(processor) or id(processor) in seen:
                continue
            seen.add(id(processor))
            kind = processor_kind(processor)
            if kind is None and id(processor) in as_sdpa:
                plan.append((processor, SDPA, model_role))
            elif kind is None:
                name = type(processor).__name__
                routing.skipped[name] = routing.skipped.get(name, 0) + 1
            else:
                plan.append((processor, kind, model_role))
    _say_what_is_left(models, plan, routing.skipped, differ)
    registry = _dispatcher_registry() if any(kind == DISPATCHER for _, kind, _ in plan) else None
    with contextlib.ExitStack() as scope:
        if parallel is not None:
            _split.split(scope, models, parallel, processor_kind, lambda model_role: _late_router(routing, model_role))
        else:
            for model, model_role in models:
                if model_role in _schedule.DENOISER:
                    _split.refuse_hooks(scope, model, split=False)
        if schedule is not None or sparse is not None:
            scope.enter_context(_use_config(schedule=schedule, sparse=sparse, hosted=True))  # checked above
        if _current_config().positional is not None:
            _follow_sampling(scope, model_or_pipeline, models, pass_name)
        if _current_config().sparse is not None:  # joint blocks tell their text tokens (kept by sparse routing)
            scope.enter_context(_joint_text.told(models))
        try:
            if registry is not None:
                _REGISTRY.enter(registry)
                routing._registry = registry
            for processor, kind, model_role in plan:
                own = type(processor)
                base = _sdpa_processor() if id(processor) in as_sdpa else own
                processor.__class__ = _routed_class(base, kind, model_role)
                routing._swapped.append((processor, own))
                routing.processors[model_role] = routing.processors.get(model_role, 0) + 1
            yield routing
        finally:
            for processor, own in reversed(routing._swapped):
                processor.__class__ = own
            routing._swapped.clear()
            if routing._registry is not None:
                _REGISTRY.exit(routing._registry)


def _say_what_is_left(models: list, plan: list, skipped: dict, differ: dict) -> None:
    """A log warning for attention ``route`` leaves as it is, and for a scope with no attention at all."""
    if skipped:
        why = {cls: differ.get(cls, "it reaches attention neither through F.scaled_dot_product_attention nor "
                                    "through diffusers' attention dispatcher") for cls in skipped}
        log.warning("route: %s left as they are, outside lib_attn and not counted: %s", ", ".join(
            f"{n} {cls}" for cls, n in skipped.items()), "; ".join(f"{cls}: {w}" for cls, w in why.items()))
    elif not plan and not any(getattr(m, "processor", None) is not None for model, _ in models for m in model.modules()):
        names = ", ".join(type(model).__name__ for model, _ in models) or "nothing (no denoiser or VAE found)"
        log.warning("route: no attention module in %s: nothing is routed", names)


def _late_router(routing: Routing, model_role: str):
    """``route_as(processor, kind)`` for a processor found on a split module as it is called: routed as
    route() would have (kind None: as ``AttnProcessor2_0``), given back its class when the scope closes."""
    def route_as(processor, kind) -> None:
        own = type(processor)
        base, kind = (own, kind) if kind else (_sdpa_processor(), SDPA)
        if kind == DISPATCHER and routing._registry is None:
            routing._registry = _dispatcher_registry()
            _REGISTRY.enter(routing._registry)
        processor.__class__ = _routed_class(base, kind, model_role)
        routing._swapped.append((processor, own))
        routing.processors[model_role] = routing.processors.get(model_role, 0) + 1

    return route_as


def _follow_sampling(scope: contextlib.ExitStack, model_or_pipeline, models: list, pass_name: str | None) -> None:
    """Number the denoisers' blocks and, for a pipeline with a scheduler, follow its steps, until
    ``scope`` closes (then no step is known)."""
    denoisers = [model for model, model_role in models if model_role in _schedule.DENOISER]
    for model in denoisers:
        scope.enter_context(_schedule.blocks(model))
    scheduler = getattr(model_or_pipeline, "scheduler", None)
    if scheduler is None or isinstance(model_or_pipeline, torch.nn.Module) or not hasattr(scheduler, "timesteps"):
        return
    sampling = Sampling(scheduler, pass_name)
    _schedule.leave()
    scope.callback(_schedule.leave)
    for model in denoisers:
        scope.callback(model.register_forward_pre_hook(sampling, with_kwargs=True).remove)
