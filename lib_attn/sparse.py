"""Sparse attention for long self-attention calls, held to an error budget the user sets; this module
holds the user's settings: which sparse backend, the error budget, the minimum tokens, the routing
knob and the dense windows, checked before anything changes.

The rest sits on the floor it serves: ``sparse_report`` (what sparse did, as data) beside ``stats``,
``sparse_measure`` (a sparse call's error) beside ``check``, and ``sparse_plan`` (what runs each call)
beside the dispatcher.

One line of text holds them all (a flag, a setting, the infotext), read by ``parse`` and written by
``Sparse.text``::

    block-sparse, budget=0.15, min_tokens=12288, topk=0.1, dense=0-20%; first 1

The method comes first; every other field may be left out (its default then holds). ``off`` (or an
empty text) is no sparse attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import schedule as _schedule
from .kernels import REGISTRY
from .kernels.sparse import Knob, is_sparse

#: The method that takes the first sparse backend, in registry order, that can take a call.
AUTO = "auto"
OFF = "off"
#: The default error budget: the largest relative L2 error of a sparse call's output against exact
#: attention. The published sparse kernels run at 0.14-0.27 on real video activations (Sol-Attn on
#: MiniMax-H3 at 104,050 tokens: top-k 20% 0.141 / 0.185 in layers 8 / 20, tau 1.0 0.166 / 0.216);
#: 0.15 takes the settings that reach the lower end and sends a call kind that cannot to a denser
#: setting, or to dense attention.
DEFAULT_BUDGET = 0.15
#: Below this many tokens a call stays dense: ComfyUI core's sparse node's ``min_tokens`` default.
DEFAULT_MIN_TOKENS = 12288
#: The sparsest keep fraction calibration may try. Calibration keeps a call kind at the sparsest
#: setting within the budget, so the floor only bounds how far down it looks: on local video-like
#: inputs (15,360 tokens, 128-token blocks) top-k 0.1 / 0.15 / 0.2 give 0.18 / 0.105 / 0.06 against
#: float64 over every row, so under the default budget such a kind runs at 15% of the blocks, where a
#: floor of 0.2 (the top-k published for Sol-Attn) would hold it at 20%. Below 0.1 a query block of a 12,288-token
#: call keeps fewer than 10 of its 96 key blocks, and the error climbs fast (0.40 at 0.05).
DEFAULT_TOPK = 0.1
#: The published dense prefix: the first 20% of the steps, and the first block.
DEFAULT_DENSE = "0-20%; first 1"
FIELDS = ("budget", "min_tokens", "topk", "threshold", "dense", "calibrate")
EXAMPLE = "block-sparse, budget=0.15, min_tokens=12288, topk=0.1, dense=0-20%; first 1"


class SparseError(ValueError):
    """Sparse settings that cannot be used; the message names the value and what is valid."""


def methods() -> tuple:
    """The valid methods: ``auto`` and the id of every registered sparse backend."""
    return (AUTO,) + tuple(bid for bid, b in REGISTRY.items() if is_sparse(b))


@dataclass(frozen=True)
class Sparse:
    """``method``: a sparse backend's id, or ``auto``; ``budget``: the largest relative L2 error of a
    call's output against exact attention, in (0, 1]; ``min_tokens``: calls with fewer query tokens
    stay dense; ``topk``: the sparsest keep fraction (of key blocks per query block) calibration may
    use, or ``threshold``: the method's own threshold instead (one of the two, never both);
    ``dense``: the windows that stay dense, schedule conditions (``lib_attn.schedule``) joined by
    ``;``, or ``""`` for none; ``calibrate``: look per call kind for the sparsest setting within the
    budget (False: the knob as given, a kind over the budget runs dense). Build with ``make``
    (checked); ``windows`` is ``dense`` parsed."""

    method: str = AUTO
    budget: float = DEFAULT_BUDGET
    min_tokens: int = DEFAULT_MIN_TOKENS
    topk: float | None = DEFAULT_TOPK
    threshold: float | None = None
    dense: str = DEFAULT_DENSE
    calibrate: bool = True
    windows: tuple = field(default=(), compare=False, repr=False)

    @property
    def knob(self) -> Knob:
        """The routing setting the user gave: the sparsest calibration may use."""
        return Knob("threshold", self.threshold) if self.threshold is not None else Knob("topk", self.topk)

    @property
    def text(self) -> str:
        """The settings' canonical one-line form (``parse`` reads it back to equal settings)."""
        exact = _schedule.number_text
        parts = [self.method, f"budget={exact(self.budget)}", f"min_tokens={self.min_tokens}", f"{self.knob.name}="
                 f"{exact(self.knob.value)}", f"dense={self.dense or 'none'}"]
        if not self.calibrate:
            parts.append("calibrate=off")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.text


def _number(name: str, value, valid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SparseError(f"sparse {name} {value!r} is not a number; valid: {valid}")
    try:
        number = float(value)
    except ValueError:
        raise SparseError(f"sparse {name} {value!r} is not a number; valid: {valid}") from None
    if not math.isfinite(number):
        raise SparseError(f"sparse {name} {value!r} is not a finite number; valid: {valid}")
    return number


def _fraction(name: str, value) -> float:
    number = _number(name, value, "a number in (0, 1]")
    if not 0 < number <= 1:
        raise SparseError(f"sparse {name} {value!r} is outside (0, 1]; valid: a number greater than 0 and at most 1")
    return number


def _count(value) -> int:
    number = _number("min_tokens", value, "a whole number >= 1")
    if number != int(number) or number < 1:
        raise SparseError(f"sparse min_tokens {value!r} must be a whole number >= 1")
    return int(number)


def _switch(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise SparseError(f"sparse calibrate {value!r} is not one of on, off")


def windows(text) -> tuple:
    """The dense windows ``text`` names, as schedule rules (their chain: the default one); () for none.
    Each window is schedule conditions (``0-20%``, ``first 1``, ``blocks 0-3``, ``sigma 14-3``, ...)."""
    if not isinstance(text, str):
        raise SparseError(f"sparse dense windows {text!r} are not text such as {DEFAULT_DENSE!r}")
    parts = [p.strip() for p in text.replace("\n", ";").split(";") if p.strip()]
    if not parts or [p.lower() for p in parts] in (["none"], ["off"]):
        return ()
    for part in parts:
        if ":" in part:
            raise SparseError(f"sparse dense window {part!r} holds ':'; a window is conditions only "
                              f"(e.g. {DEFAULT_DENSE!r}): the calls it takes run the dense configuration")
    try:
        rules = _schedule.parse("; ".join(f"{p}: {_schedule.AUTO}" for p in parts))
    except _schedule.ScheduleError as exc:
        problem = str(exc).replace("schedule rule", "window", 1).replace(f": {_schedule.AUTO}", "")
        raise SparseError(f"sparse dense windows {text!r}: {problem}") from None
    return rules.rules


def make(method=AUTO, budget=None, min_tokens=None, topk=None, threshold=None, dense=None,
         calibrate=True) -> Sparse:
    """Checked sparse settings; an argument left at None takes its default (with neither ``topk`` nor
    ``threshold``: the named method's default setting where it is a threshold, else ``DEFAULT_TOPK``). ``SparseError`` (a ValueError) names the value and the valid ones."""
    budget = DEFAULT_BUDGET if budget is None else budget
    min_tokens = DEFAULT_MIN_TOKENS if min_tokens is None else min_tokens
    dense = DEFAULT_DENSE if dense is None else dense
    valid = methods()
    if method not in valid:
        raise SparseError(f"sparse method {method!r} is not one of {', '.join(valid)}")
    budget = _fraction("budget", budget)
    min_tokens = _count(min_tokens)
    if topk is not None and threshold is not None:
        raise SparseError(f"sparse settings give topk={topk!r} and threshold={threshold!r}; give one of them "
                          "(topk: a keep fraction of key blocks; threshold: the method's own)")
    if topk is None and threshold is None and method != AUTO and REGISTRY[method].default_knob.name == "threshold":
        threshold = REGISTRY[method].default_knob.value  # a method whose own default is a threshold (sol: tau 1.3)
    if threshold is not None:
        if method == AUTO:
            raise SparseError("sparse threshold needs a named method (each method's threshold means something "
                              f"else); valid methods: {', '.join(valid[1:])}")
        threshold = _number("threshold", threshold, "a number")
        problem = REGISTRY[method].threshold_problem(threshold)
        if problem:
            raise SparseError(f"sparse {problem}")
    else:
        topk = DEFAULT_TOPK if topk is None else _fraction("topk", topk)
    rules = windows(dense)
    canonical = "; ".join(r.label for r in rules)
    return Sparse(method, budget, min_tokens, topk if threshold is None else None, threshold, canonical,
                  _switch(calibrate), rules)


def parse(value) -> Sparse | None:
    """Sparse settings from what a user gives: None, ``False``, ``""`` or ``"off"`` (no sparse), a
    ``Sparse`` (returned as it is), a dict of ``make``'s arguments, ``True`` (every default) or one line
    of text (see the module). ``SparseError`` names the value that is wrong and the valid ones."""
    if value is None or value is False:
        return None
    if isinstance(value, Sparse):
        return value
    if value is True:
        return make()
    if isinstance(value, dict):
        unknown = [key for key in value if key not in ("method",) + FIELDS]
        if unknown:
            raise SparseError(f"unknown sparse setting {', '.join(map(repr, unknown))}; valid: method, "
                              f"{', '.join(FIELDS)}")
        return make(**value)
    if not isinstance(value, str):
        raise SparseError(f"sparse settings are text such as {EXAMPLE!r}, a dict or None; got "
                          f"{type(value).__name__}")
    text = value.strip()
    if not text or text.lower() == OFF:
        return None
    head, _, rest = text.partition(",")
    args: dict = {"method": head.strip()}
    if "=" in args["method"]:
        raise SparseError(f"sparse settings {text!r} start with a method ({', '.join(methods())}), then "
                          f"name=value fields; e.g. {EXAMPLE!r}")
    for part in (p.strip() for p in rest.split(",")):
        if not part:
            continue
        name, eq, val = part.partition("=")
        name = name.strip().lower().replace(" ", "_").replace("-", "_")
        if not eq or name not in FIELDS:
            raise SparseError(f"sparse setting {part!r} is not name=value with a name of {', '.join(FIELDS)}")
        if name in args:
            raise SparseError(f"sparse setting {name!r} given twice in {text!r}")
        args[name] = val.strip()
    return make(**args)

