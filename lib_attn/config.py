"""The engine's configuration: preference chains per role, backends to avoid, fp32 policy, strict mode, tuning,
the output guard, the schedule, sparse attention."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace

import torch

from . import schedule as _schedule
from . import scope as _scope
from . import sparse as _sparse
from .device import DeviceInfo, device_info
from .kernels import BACKEND_IDS, REGISTRY, not_in_chains, status
from .spec import ROLES, CallSpec

FP32_POLICIES = ("cast", "keep")
#: ``auto``: measure on CUDA devices, fixed order elsewhere; ``on``: measure on every device;
#: ``off``: the fixed order everywhere.
TUNE_MODES = ("auto", "on", "off")
#: ``on``: each kernel's first call of each signature checked against the bounded reference, then its
#: output watched for non-finite values (see ``lib_attn.guard``); ``full``: every call checked, at once;
#: ``off``: no check.
GUARD_MODES = ("on", "full", "off")


@dataclass(frozen=True)
class Config:
    """``preference`` maps each role to a tuple of backend ids, or None for the default chain;
    ``avoid``: backend ids the default chains leave out (a chain the user names may still hold them);
    ``schedule``: a ``lib_attn.schedule.Schedule`` whose rules choose the chain for the calls they take, or None.
    ``sparse``: ``lib_attn.sparse.Sparse`` settings, or None (no sparse attention).
    ``token``: a small number that equal configurations share (the dispatcher keys decisions on it), in this
    process; ``canonical``: what makes two configurations equal, in any process (a host's cache keys)."""

    preference: dict = field(default_factory=lambda: {role: None for role in ROLES})
    fp32: str = "cast"
    strict: bool = False
    tune: str = "auto"
    avoid: tuple = ()
    guard: str = "on"
    schedule: _schedule.Schedule | None = None
    sparse: _sparse.Sparse | None = None
    token: int = field(default=0, init=False, compare=False, repr=False)
    canonical: tuple = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self):
        canonical = (tuple(sorted(self.preference.items())), self.fp32, self.strict, self.tune, self.avoid,
                     self.guard, None if self.schedule is None else self.schedule.text,
                     None if self.sparse is None else self.sparse.text)
        object.__setattr__(self, "canonical", canonical)
        object.__setattr__(self, "token", _TOKENS.setdefault(canonical, len(_TOKENS)))

    @functools.cached_property
    def positional(self) -> _schedule.Schedule | None:
        """What the position of sampling is matched against: the schedule's rules, then the sparse dense
        windows (numbered after them), so that a host tells steps and blocks when either asks for them."""
        windows = self.sparse.windows if self.sparse is not None else ()
        if not windows:
            return self.schedule
        rules = self.schedule.rules if self.schedule is not None else ()
        return _schedule.Schedule(rules + tuple(replace(w, index=len(rules) + i) for i, w in enumerate(windows)))


_TOKENS: dict = {}
_config = Config()
_scope.GLOBAL.config = _config
_listeners: list = []


def parse_ids(text) -> tuple[list[str], list[str]]:
    """A chain typed as text, ``"a,b, c"`` (a flag, a setting, a node's input): (known backend ids, unknown
    ones), each in order, without repeats."""
    known, unknown = [], []
    for part in str(text or "").split(","):
        item = part.strip()
        if not item or item in known or item in unknown:
            continue
        (known if item in BACKEND_IDS else unknown).append(item)
    return known, unknown


def _check_ids(ids, where: str) -> tuple:
    if isinstance(ids, str):
        ids = [part.strip() for part in ids.split(",") if part.strip()]
    ids = tuple(ids)
    sparse = not_in_chains(ids)
    if sparse:
        raise ValueError(f"{sparse} (in {where})")
    unknown = [i for i in ids if i not in BACKEND_IDS]
    if unknown:
        raise ValueError(f"unknown backend id {', '.join(map(repr, unknown))} in {where}; valid ids: {', '.join(BACKEND_IDS)}")
    return ids


def _chain(value, where: str):
    if value is None or value == "auto" or (not isinstance(value, str) and len(value) == 0):
        return None
    return _check_ids(value, where) or None


def normalise_preference(preference) -> dict:
    """``"auto"``, a list of ids for every role, or a dict role -> ids, as a dict over every role.

    A list for every role leaves ``sage`` out of the VAE's chain: SageAttention is for the denoiser,
    and reaches the VAE only when the VAE's chain names it.
    """
    if preference is None or preference == "auto":
        return {role: None for role in ROLES}
    if isinstance(preference, dict):
        unknown = [r for r in preference if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown role {', '.join(map(repr, unknown))} in preference; valid roles: {', '.join(ROLES)}")
        return {role: _chain(preference.get(role), f"preference[{role!r}]") for role in ROLES}
    chain = _chain(preference, "preference")
    out = {role: chain for role in ROLES}
    if chain is not None:
        out["vae"] = tuple(i for i in chain if i != "sage") or None
    return out


def current() -> Config:
    """The configuration in force here: the one ``use`` put in force in this thread or task, else the
    process-wide one."""
    return _scope.current().config or _scope.GLOBAL.config


def _mode(value, modes: tuple, name: str) -> str:
    """A switch's mode from ``value`` (True and False stand for on and off); ValueError names the valid ones."""
    if value is True or value is False:
        return "on" if value else "off"
    if value not in modes:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(modes)}")
    return value


def _cannot_run(bid: str, settings, device) -> list[str]:
    """Why sparse backend ``bid`` can take no call of these settings on ``device``: a call it would be
    most likely to take (self-attention of ``min_tokens`` tokens, one head, head dim 128) is refused."""
    found = status(bid)
    if not found.available:
        return [f"not available: {found.reason}"]
    backend = REGISTRY[bid]
    dtype = torch.float32 if backend.takes_dtype(torch.float32, device.type) else device.half_dtype
    tokens = settings.min_tokens
    return backend.reasons(CallSpec(device, dtype, 1, 1, tokens, tokens, 128, role="dit"),
                           asked=settings.method != _sparse.AUTO)


def sparse_problem(settings, device=None) -> str:
    """Why sparse ``settings`` cannot run on ``device`` (a ``DeviceInfo``, a torch device or its name; this
    machine's default device when None): every call would run dense. The text names the method, why, what to do and the methods
    that can run there; "" when they can (or for no settings)."""
    if settings is None:
        return ""
    device = device if isinstance(device, DeviceInfo) else device_info(device)
    named = settings.method != _sparse.AUTO
    candidates = (settings.method,) if named else _sparse.methods()[1:]
    why = {bid: _cannot_run(bid, settings, device) for bid in candidates}
    if not all(why.values()):
        return ""
    others = [bid for bid in _sparse.methods()[1:] if bid not in why and not _cannot_run(bid, settings, device)]
    todo = sorted({f"pip install {REGISTRY[bid].packages[0]}" for bid, reasons in why.items()
                   if REGISTRY[bid].packages and reasons[0].startswith("not available")})
    text = (f"sparse method {settings.method!r} cannot run on this device ({device.type}: {device.describe()}), "
            "every call would run dense: "
            + "; ".join(f"{bid}: {'; '.join(reasons)}" for bid, reasons in why.items()))
    if todo:
        text += f". To install: {', '.join(todo)}"
    usable = ([_sparse.AUTO] + others) if others else []
    return text + (f". Methods that can run here: {', '.join(usable)}; or 'off' for none" if usable else
                   ". No sparse method can run here; 'off' for none")


def checked_sparse(value, device=None):
    """Sparse settings as a script puts them in force: ``lib_attn.sparse.parse(value)``, refused with
    ``SparseError`` (``sparse_problem``'s text) where their method cannot run on ``device``."""
    settings = _sparse.parse(value)
    problem = sparse_problem(settings, device)
    if problem:
        raise _sparse.SparseError(problem)
    return settings


def configure(preference=None, fp32=None, strict=None, tune=None, avoid=None, guard=None, schedule=None,
              sparse=None, *, hosted: bool = False) -> Config:
    """Change the process-wide configuration; an argument left at None keeps its current value. (Inside
    a ``use`` block the configuration ``use`` put in force stays in force there until the block ends.)

    ``preference``: ``"auto"``, a list of backend ids for every role, or a dict role -> list
    (``"auto"`` or ``[]`` for the default chain). ``fp32``: ``"cast"`` (fp32 inputs are cast to
    bf16/fp16 for half-only kernels, output cast back) or ``"keep"`` (only fp32-capable kernels).
    ``strict``: when True, every fallback raises ``AttentionFallbackError``. ``tune``: ``"auto"``
    (measure on CUDA devices), ``"on"`` (measure on every device) or ``"off"`` (fixed order); True and
    False stand for on and off. Measuring ranks the backends that take a call kind on its first call,
    and is kept on disk (see ``lib_attn.tune``). ``avoid``: backend ids (a list, or ``"a,b"``) that
    the default chains leave out, as a host does for a kernel its user disabled; ``math`` is never
    left out, and a chain named in ``preference`` keeps what it names. ``guard``: ``"on"`` (each
    kernel's first call of each call signature is checked against a reference and its output is then
    watched for non-finite values), ``"full"`` (every call checked at once) or ``"off"``; True and
    False stand for on and off (see ``lib_attn.guard``). ``schedule``: rules that choose the chain by
    sampling progress, block and role, as one line of text (``"0-20%: sdpa; 20-80%: sage; 80-100%: sdpa"``)
    or a ``Schedule``; ``""`` for none (see ``lib_attn.schedule``). ``sparse``: sparse attention for
    long self-attention calls, held to an error budget: one line of text
    (``"block-sparse, budget=0.15, min_tokens=12288, topk=0.1, dense=0-20%; first 1"``), a dict of
    its fields, True (every default) or a ``lib_attn.sparse.Sparse``; ``""``, ``"off"`` or False for
    none (see ``lib_attn.sparse``); a method that cannot run on this machine's default device (not
    installed, or not on this device) raises ``SparseError`` saying why, what to do and the methods that
    can. Every argument is checked before anything changes: a ValueError leaves the configuration as it
    was. ``hosted``: a host's settings (a webui's, a node's), which must never fail a page or a
    generation: a sparse method that cannot run here is put in force, its calls run dense and the
    report says why.
    """
    _set(_merged(_config, preference, fp32, strict, tune, avoid, guard, schedule, sparse, hosted))
    return _config


def _merged(base: Config, preference, fp32, strict, tune, avoid, guard, schedule, sparse, hosted) -> Config:
    """``base`` with the arguments that are not None, each checked (ValueError before anything changes)."""
    pref = base.preference if preference is None else normalise_preference(preference)
    left_out = base.avoid if avoid is None else tuple(i for i in _check_ids(avoid, "avoid") if i != "math")
    if fp32 is not None and fp32 not in FP32_POLICIES:
        raise ValueError(f"fp32 policy {fp32!r} is not one of {', '.join(FP32_POLICIES)}")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"strict must be a bool, got {type(strict).__name__}")
    mode = base.tune if tune is None else _mode(tune, TUNE_MODES, "tune")
    guard_mode = base.guard if guard is None else _mode(guard, GUARD_MODES, "guard")
    rules = base.schedule if schedule is None else _schedule.parse(schedule)
    sparse_settings = base.sparse if sparse is None else (_sparse.parse if hosted else checked_sparse)(sparse)
    return Config(pref, base.fp32 if fp32 is None else fp32, base.strict if strict is None else strict, mode,
                  left_out, guard_mode, rules, sparse_settings)


def _set(new: Config) -> None:
    global _config
    if new != _config:  # hosts re-apply their settings every generation: keep decisions if nothing changed
        _config = _scope.GLOBAL.config = new
        _schedule.use(new.positional)
        for listener in _listeners:
            listener()


@contextlib.contextmanager
def use(preference=None, fp32=None, strict=None, tune=None, avoid=None, guard=None, schedule=None, sparse=None, *,
        hosted: bool = False):
    """The configuration in force here with these arguments changed (as ``configure`` takes them), for
    the ``with`` block and in this thread or task only: other threads keep theirs, and the one in force
    here before returns on exit. The block has its own schedule position (starting where sampling was
    when it began); recordings open here count its calls."""
    outer = _scope.current()
    new = _merged(outer.config or _config, preference, fp32, strict, tune, avoid, guard, schedule, sparse, hosted)
    with _scope.entered(_scope.Scope(new, _schedule.Where(new.positional, like=outer.where), outer.recordings)):
        yield new


def on_change(listener) -> None:
    """Call ``listener()`` after every configuration change (the dispatcher drops its decisions)."""
    _listeners.append(listener)
