"""Schedules: which chain of backends serves which calls, by sampling progress, block and role.

A schedule is a list of rules, typed on one line::

    cross: sdpa; 0-20%: sdpa; 20-80%: sage3, sage; 80-100%: sdpa; vae: sdpa-efficient

Each rule is ``conditions: chain``. A call takes the chain of the first rule whose conditions all
hold for it; a call no rule takes keeps the ordinary configuration (the backend setting, the flags,
Auto). The chain is backend ids tried in order, falling back per call as everywhere, or ``auto``
(the default chain). Conditions (``TERMS``):

* ``A-B%``: the fraction of the pass's steps done is in [A%, B%) (a window up to 100% takes 100% too);
  ``steps A-B%`` says the same;
* ``sigma X-Y``: the sampler's current sigma lies between X and Y (where the host gives sigmas);
* ``self``, ``cross``, ``joint``: the kind of attention (see ``kind``);
* ``first N``, ``last N``, ``blocks A-B``: the model's numbered blocks (see ``BLOCK_LISTS``), 0-based,
  in the order its forward runs them;
* ``unet``, ``dit``, ``vae``: the role; a rule that names none applies to the denoiser (UNet and DiT);
* ``base``, ``hires``, ``refiner``: the pass (the first pass, the hires fix pass, the refiner's steps).

Where a call is (``position()``: the process's ``where``, or that of the scope ``use`` entered, see
``lib_attn.scope``) is told by the host: the step at each sampler step (``at_step``), the block as
each block starts (``blocks``, forward pre-hooks on the model's block lists). The position changes a
few times per step, never per call: each change recomputes its ``token``, the rules its step, pass
and block let through, and the dispatcher keys its decisions on that token, so a call pays one
attribute read for the schedule. A condition the host cannot tell (no step outside a
sampling pass, no block in a model whose blocks are not known) does not hold.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
from dataclasses import dataclass

import torch

from . import scope as _scope
from .kernels import BACKEND_IDS, not_in_chains

log = logging.getLogger("lib_attn")

#: The chain word that means the default chain.
AUTO = "auto"
DENOISER = frozenset(("unet", "dit"))
ROLE_WORDS = ("unet", "dit", "vae")
KINDS = ("self", "cross", "joint")
PASSES = ("base", "hires", "refiner")
#: The label of the calls no rule took, while a schedule is in force.
OTHERWISE = "otherwise"
TERMS = ("A-B% (steps done)", "sigma X-Y", *KINDS, "first N", "last N", "blocks A-B", *ROLE_WORDS, *PASSES)
EXAMPLE = "0-20%: sdpa; 20-80%: sage; 80-100%: sdpa"

_NUMBER = r"\d+(?:\.\d+)?"
_DASH = r"\s*[-–]\s*"
_PERCENT = re.compile(rf"^(?:steps\s+)?({_NUMBER}){_DASH}({_NUMBER})\s*%$")
_SIGMA = re.compile(rf"^sigma\s+({_NUMBER}){_DASH}({_NUMBER})$")
_BLOCKS = re.compile(rf"^blocks\s+(\d+){_DASH}(\d+)$")
_FIRST_LAST = re.compile(r"^(first|last)\s+(\d+)$")
#: One term at the start of a rule's conditions (a term may hold spaces: ``steps 0-20%``).
_TERM = re.compile(rf"(?:steps\s+)?{_NUMBER}{_DASH}{_NUMBER}\s*%|sigma\s+{_NUMBER}{_DASH}{_NUMBER}"
                   rf"|blocks\s+\d+{_DASH}\d+|(?:first|last)\s+\d+|\S+")


@dataclass(frozen=True)
class Rule:
    """One rule: its conditions and its chain (None: the default chain). ``label`` is its conditions
    in canonical form (what the readout counts under); ``index`` its place in the schedule."""

    label: str
    chain: tuple | None
    index: int = 0
    steps: tuple | None = None    # (from, to) fractions of the pass's steps, to exclusive
    sigmas: tuple | None = None   # (low, high), both inclusive
    kinds: frozenset = frozenset()
    blocks: tuple | None = None   # ("first", n), ("last", n) or ("range", a, b)
    roles: frozenset = DENOISER
    passes: frozenset = frozenset()

    def holds_at(self, where: "Where") -> bool:
        """The conditions that depend on where sampling is, against ``where``."""
        if self.steps is not None and (where.progress is None or not (self.steps[0] <= where.progress < self.steps[1]
                                                                      or where.progress == self.steps[1] == 1.0)):
            return False  # [A, B), and a window up to 100% also holds when a host reports every step done
        if self.sigmas is not None and (where.sigma is None or not self.sigmas[0] <= where.sigma <= self.sigmas[1]):
            return False
        if self.passes and where.pass_name not in self.passes:
            return False
        if self.blocks is not None:
            if where.block is None or where.blocks is None:
                return False
            what = self.blocks[0]
            if what == "first":
                return where.block < self.blocks[1]
            if what == "last":
                return where.block >= where.blocks - self.blocks[1]
            return self.blocks[1] <= where.block <= self.blocks[2]
        return True

    def takes(self, role: str, kind: str) -> bool:
        return role in self.roles and (not self.kinds or kind in self.kinds)

    def text(self) -> str:
        return f"{self.label}: {', '.join(self.chain) if self.chain else AUTO}"


@dataclass(frozen=True)
class Schedule:
    """Rules in the order they are tried. What a host must tell for them is read once per schedule:
    ``asks_step`` (a step window or sigma range), ``asks_sigma``, ``asks_blocks`` (a block condition
    or ``joint``, which the block hooks tell)."""

    rules: tuple = ()

    @functools.cached_property
    def text(self) -> str:
        """The rules' canonical one-line form (``parse`` reads it back to an equal schedule)."""
        return "; ".join(r.text() for r in self.rules)

    @functools.cached_property
    def asks_step(self) -> bool:
        return any(r.steps is not None or r.sigmas is not None for r in self.rules)

    @functools.cached_property
    def asks_sigma(self) -> bool:
        return any(r.sigmas is not None for r in self.rules)

    @functools.cached_property
    def asks_blocks(self) -> bool:
        return any(r.blocks is not None or "joint" in r.kinds for r in self.rules)

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.rules]

    def rule(self, label: str) -> Rule | None:
        return next((r for r in self.rules if r.label == label), None)

    def __str__(self) -> str:
        return self.text


class ScheduleError(ValueError):
    """A schedule that cannot be used; the message names the rule, the part and what is valid."""


def number_text(value: float) -> str:
    """``value`` as short as it reads back exactly: ``0.15``, ``20``, ``0.1500004`` (never rounded, so two
    different settings never write the same text)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def _fail(n: int, rule: str, problem: str) -> ScheduleError:
    return ScheduleError(f"schedule rule {n} ({rule.strip()!r}): {problem}")


def _chain(n: int, rule: str, text: str) -> tuple | None:
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise _fail(n, rule, f"no backend after ':'; write backend ids (e.g. sdpa, sage) or {AUTO}")
    if ids == [AUTO]:
        return None
    sparse = not_in_chains(ids)
    if sparse:
        raise _fail(n, rule, sparse)
    unknown = [i for i in ids if i not in BACKEND_IDS]
    if unknown:
        raise _fail(n, rule, f"unknown backend id {', '.join(map(repr, unknown))}; valid ids: "
                             f"{', '.join(BACKEND_IDS)}, or {AUTO}")
    return tuple(dict.fromkeys(ids))


def _rule(n: int, text: str, index: int) -> Rule:
    head, colon, tail = text.partition(":")
    if not colon:
        raise _fail(n, text, f"no ':' between conditions and backends; a rule reads like '20-80%: sage' "
                             f"(example: {EXAMPLE!r})")
    terms = _TERM.findall(head.strip().lower())
    if not terms:
        raise _fail(n, text, f"no condition before ':'; valid conditions: {', '.join(TERMS)}")
    found: dict = {"kinds": set(), "roles": set(), "passes": set()}
    canon = []
    for term in terms:
        term = " ".join(term.split())
        m = _PERCENT.match(term)
        if m:
            lo, hi = float(m[1]), float(m[2])
            if not 0 <= lo < hi <= 100:
                raise _fail(n, text, f"step window {term!r} must run from a lower to a higher percentage within 0-100%")
            _once(n, text, found, "steps", (lo / 100, hi / 100), "step window")
            canon.append(f"{number_text(lo)}-{number_text(hi)}%")
            continue
        m = _SIGMA.match(term)
        if m:
            a, b = float(m[1]), float(m[2])
            _once(n, text, found, "sigmas", (min(a, b), max(a, b)), "sigma range")
            canon.append(f"sigma {number_text(max(a, b))}-{number_text(min(a, b))}")
            continue
        m = _BLOCKS.match(term)
        if m:
            a, b = int(m[1]), int(m[2])
            if a > b:
                raise _fail(n, text, f"block range {term!r} must run from the lower index to the higher")
            _once(n, text, found, "blocks", ("range", a, b), "block condition")
            canon.append(f"blocks {a}-{b}")
            continue
        m = _FIRST_LAST.match(term)
        if m:
            if int(m[2]) < 1:
                raise _fail(n, text, f"{term!r} names no block; write {m[1]} N with N >= 1")
            _once(n, text, found, "blocks", (m[1], int(m[2])), "block condition")
            canon.append(f"{m[1]} {int(m[2])}")
            continue
        for group, words in (("kinds", KINDS), ("roles", ROLE_WORDS), ("passes", PASSES)):
            if term in words:
                found[group].add(term)
                break
        else:
            raise _fail(n, text, f"{term!r} is not a condition; valid conditions: {', '.join(TERMS)}")
    roles = frozenset(found["roles"]) or DENOISER
    if "vae" in roles:
        asked = [t for t in ("steps", "sigmas", "blocks") if t in found] + sorted(found["kinds"] | found["passes"])
        if asked:
            raise _fail(n, text, f"the VAE has no steps, blocks, passes or attention kinds, so 'vae' cannot be "
                                 f"combined with {', '.join(asked)}; write a separate 'vae: ...' rule")
    words = [w for w in (*KINDS, *ROLE_WORDS, *PASSES) if w in found["kinds"] | found["roles"] | found["passes"]]
    label = " ".join(canon + words)
    return Rule(label, _chain(n, text, tail), index, found.get("steps"), found.get("sigmas"),
                frozenset(found["kinds"]), found.get("blocks"), roles, frozenset(found["passes"]))


def _once(n: int, text: str, found: dict, key: str, value, what: str) -> None:
    if key in found:
        raise _fail(n, text, f"more than one {what} in one rule; a rule holds when all its conditions do, so write one "
                             f"per rule (or one rule per window)")
    found[key] = value


def parse(text) -> Schedule | None:
    """The schedule ``text`` describes; None for an empty text (no schedule). A ``Schedule`` is
    returned as it is. ``ScheduleError`` (a ValueError) names the rule, the part that is wrong and
    what is valid; a schedule is used whole or not at all."""
    if text is None or isinstance(text, Schedule):
        return text
    if not isinstance(text, str):
        raise ScheduleError(f"a schedule is text such as {EXAMPLE!r}, got {type(text).__name__}")
    parts = [p for p in (part.strip() for part in text.replace("\n", ";").split(";")) if p]
    if not parts or [p.lower() for p in parts] in (["none"], ["off"]):
        return None
    rules = []
    for i, part in enumerate(parts):
        rule = _rule(i + 1, part, i)
        earlier = next((r for r in rules if r.label == rule.label), None)
        if earlier is not None:
            raise _fail(i + 1, part, f"same conditions as rule {earlier.index + 1} ({earlier.label!r}), which "
                                     f"takes every call this one would: join their backends in one rule")
        shadow = shadowing(rules, rule)
        if shadow:
            raise _fail(i + 1, part, f"never holds: {_rule_names(shadow)} every call it would first; move it "
                                     f"before rule {shadow[0].index + 1}, or narrow it")
        shadow = shadowing(rules, rule, known_step=True)
        if shadow:
            _warn_once(f"schedule rule {i + 1} ({part.strip()!r}) takes only calls made where no sampling step is "
                       f"known: {_rule_names(shadow)} every call of it at a known step first; move it before rule "
                       f"{shadow[0].index + 1} for it to hold while sampling")
        rules.append(rule)
    return Schedule(tuple(rules))


def _rule_names(rules: list) -> str:
    """The rules named, with ``take`` agreeing: ``rule 1 ('0-50%') takes``, ``rule 1 (…) and rule 2 (…) take``."""
    names = [f"rule {r.index + 1} ({r.label!r})" for r in rules]
    return f"{names[0]} takes" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]} take"


@functools.lru_cache(maxsize=64)
def _warn_once(text: str) -> None:
    log.warning(text)


#: The kinds of attention each role's calls can be (``kind``: only a DiT's calls are joint).
ROLE_KINDS = {"unet": ("self", "cross"), "dit": KINDS, "vae": ("self", "cross")}
#: A position the host does not tell (no step known, no pass named), or a rule with no condition on it.
_UNKNOWN = None


def shadowing(earlier: list, rule: Rule, known_step: bool = False) -> list:
    """The earlier rules that together take every call ``rule`` would, first ([] when some call reaches
    it): each call goes to the first rule that holds for it, so one rule or several (``self`` and
    ``cross``; step windows or sigma ranges that cover ``rule``'s between them) may leave it none.
    ``known_step``: only the calls made at a known step (a rule with no step window also takes those
    made where no step is known, which rules with step windows never take)."""
    dims = _dimensions(earlier, rule)
    region = tuple(own for own, _ in dims)
    if known_step and rule.steps is None:
        region = region[:2] + (region[2] - {_UNKNOWN},) + region[3:]
    sets = [tuple(of(r) for _, of in dims) for r in earlier]
    takers: set = set()
    if not _covered(region, list(zip(earlier, sets)), takers):
        return []
    return sorted(takers, key=lambda r: r.index)


def _covered(region: tuple, candidates: list, takers: set) -> bool:
    """Whether the earlier rules take every call of ``region`` (a set of atoms per dimension), each call
    by the first of them that holds for it; the rules that take some are added to ``takers``."""
    candidates = [(r, sets) for r, sets in candidates if all(own & part for own, part in zip(sets, region))]
    if not candidates:
        return False
    (first, sets), rest = candidates[0], candidates[1:]
    d = next((d for d, (own, part) in enumerate(zip(sets, region)) if not part <= own), None)
    if d is None:
        takers.add(first)
        return True
    inside = region[:d] + (region[d] & sets[d],) + region[d + 1:]
    outside = region[:d] + (region[d] - sets[d],) + region[d + 1:]
    return _covered(inside, candidates, takers) and _covered(outside, rest, takers)


def _dimensions(earlier: list, rule: Rule) -> list:
    """Per condition, (``rule``'s calls as a set of atoms, a function giving an earlier rule's atoms):
    role and kind; pass; step window; sigma range; blocks. Windows are cut at every earlier rule's bounds."""
    def pairs(r):
        return frozenset((role, k) for role in r.roles for k in ROLE_KINDS[role] if not r.kinds or k in r.kinds)

    passes = frozenset(rule.passes) or frozenset(PASSES + (_UNKNOWN,))
    return [(pairs(rule), pairs), (passes, lambda r: frozenset(r.passes) or passes),
            _step_atoms(earlier, rule), _sigma_atoms(earlier, rule), _block_atoms(earlier, rule)]


def _cuts(lo: float, hi: float, windows) -> list:
    """``lo``, ``hi`` and every bound of ``windows`` (pairs, or None) strictly between them, in order."""
    return sorted({lo, hi} | {x for w in windows if w for x in w if lo < x < hi})


def _step_atoms(earlier: list, rule: Rule) -> tuple:
    # [A, B) windows cut where any rule's starts or ends; a window up to 100% also takes 100% (the atom 1.0)
    lo, hi = rule.steps or (0.0, 1.0)
    cuts = _cuts(lo, hi, (r.steps for r in earlier))
    atoms = frozenset(zip(cuts, cuts[1:])) | ({1.0} if hi == 1.0 else set()) | (
        {_UNKNOWN} if rule.steps is None else set())

    def of(r):
        if r.steps is None:
            return atoms
        return frozenset(a for a in atoms if a is not _UNKNOWN and (
            r.steps[1] == 1.0 if a == 1.0 else r.steps[0] <= a[0] and a[1] <= r.steps[1]))
    return atoms, of


def _sigma_atoms(earlier: list, rule: Rule) -> tuple:
    # inclusive ranges: each bound is an atom and so is each open stretch between two; a rule with no range
    # also takes calls where no sigma is known, which only another rule with no range takes
    if rule.sigmas is None:
        return frozenset({_UNKNOWN}), lambda r: frozenset({_UNKNOWN}) if r.sigmas is None else frozenset()
    lo, hi = rule.sigmas
    cuts = _cuts(lo, hi, (r.sigmas for r in earlier))
    atoms = frozenset([(x, x) for x in cuts] + [(a, b, "open") for a, b in zip(cuts, cuts[1:])])
    return atoms, lambda r: atoms if r.sigmas is None else frozenset(
        a for a in atoms if r.sigmas[0] <= a[0] and a[1] <= r.sigmas[1])


def _block_atoms(earlier: list, rule: Rule) -> tuple:
    # ``first N`` is blocks 0..N-1 in any model; ``last N`` depends on the model's count, so only another
    # ``last`` reaching as far takes it; a rule with no block condition also takes calls in unknown blocks
    def span(blocks):
        return (0, blocks[1] - 1) if blocks[0] == "first" else (blocks[1], blocks[2])

    def any_block(r):
        return atoms if r.blocks is None else frozenset()
    if rule.blocks is None:
        atoms = frozenset({_UNKNOWN})
        return atoms, any_block
    if rule.blocks[0] == "last":
        atoms = frozenset({rule.blocks})
        return atoms, lambda r: atoms if r.blocks is None or (r.blocks[0] == "last" and r.blocks[1] >= rule.blocks[1]) \
            else frozenset()
    lo, hi = span(rule.blocks)
    cuts = sorted({lo, hi + 1} | {x for r in earlier if r.blocks and r.blocks[0] != "last"
                                  for x in (span(r.blocks)[0], span(r.blocks)[1] + 1) if lo < x <= hi})
    atoms = frozenset((a, b - 1) for a, b in zip(cuts, cuts[1:]))
    return atoms, lambda r: any_block(r) if r.blocks is None or r.blocks[0] == "last" else frozenset(
        a for a in atoms if span(r.blocks)[0] <= a[0] and a[1] <= span(r.blocks)[1])


# --- where sampling is ------------------------------------------------------------------------------

class Where:
    """Where the host's sampling is: ``progress`` (fraction of the pass's steps done), ``sigma``,
    ``pass_name``, ``call`` (which model call of the step, from 0: a host that runs CFG's passes as
    separate model calls tells the step at each), ``block`` of ``blocks`` and whether that block's
    attention is ``joint``; None where unknown. ``token`` is what the dispatcher keys on (see ``recompute``). Each scope
    (``lib_attn.scope``) has its own; ``where`` is the process's."""

    def __init__(self, schedule: Schedule | None = None, like: "Where | None" = None):
        self.progress = self.sigma = self.pass_name = self.block = self.blocks = self.call = None
        self.joint = False
        if like is not None:  # a scope entered mid-sampling keeps the position it was entered at
            self.progress, self.sigma, self.pass_name = like.progress, like.sigma, like.pass_name
            self.call = like.call
            self.block, self.blocks, self.joint = like.block, like.blocks, like.joint
        self.schedule = schedule
        self.token = None
        self.recompute()

    def recompute(self) -> None:
        """``token``: None without a schedule, else (joint, indices of the rules whose step, pass and
        block conditions hold now). Rules without such conditions are always in it."""
        schedule = self.schedule
        self.token = None if schedule is None else (self.joint, tuple(r.index for r in schedule.rules
                                                                      if r.holds_at(self)))


where = Where()
_scope.GLOBAL.where = where


def position() -> Where:
    """The position of the scope in force: the process's ``where`` unless ``use`` entered one."""
    return _scope.current().where


def use(schedule: Schedule | None) -> None:
    """The process-wide schedule changed (the configuration calls this)."""
    where.schedule = schedule
    where.recompute()


def at_step(step: int | None, total: int | None, sigma: float | None = None, pass_name: str | None = None) -> None:
    """The host's sampler starts step ``step`` (0-based) of ``total`` in pass ``pass_name``; ``sigma``
    where known. The block is unknown until the next block starts. The same step told again is the
    step's next model call (``Where.call``)."""
    here = position()
    progress = None if step is None or not total else min(max(step / total, 0.0), 1.0)
    again = progress is not None and here.call is not None and (progress, pass_name) == (here.progress, here.pass_name)
    here.call = here.call + 1 if again else (None if progress is None else 0)
    here.progress = progress
    here.sigma = None if sigma is None else float(sigma)
    here.pass_name = pass_name
    here.block = None
    if here.schedule is not None:
        here.recompute()


def at_block(index: int | None, total: int | None, joint: bool = False) -> None:
    """Block ``index`` of ``total`` (0-based, forward order) starts; ``joint``: its attention runs over
    text and image tokens together."""
    here = position()
    here.block, here.blocks, here.joint = index, total, joint
    if here.schedule is not None:
        here.recompute()


def leave() -> None:
    """Sampling is over (or has not begun): no step, pass or block is known."""
    here = position()
    here.progress = here.sigma = here.pass_name = here.block = here.blocks = here.call = None
    here.joint = False
    here.recompute()


def sigma_of_alpha_bar(alpha_bar: float) -> float | None:
    """The sigma of a timestep whose cumulative alpha is ``alpha_bar``: ``sqrt((1 - a) / a)``, the scale
    of the k-diffusion samplers' sigmas, for samplers that step by timestep (DDIM, PLMS, DDPM)."""
    return ((1 - alpha_bar) / alpha_bar) ** 0.5 if alpha_bar > 0 else None


def kind(role: str, q_len: int, kv_len: int, joint: bool) -> str:
    """``cross`` when keys come from another sequence than queries (their lengths differ), ``joint``
    for the rest of a block that attends over text and image tokens together, else ``self``."""
    if q_len != kv_len:
        return "cross"
    return "joint" if joint and role == "dit" else "self"


def rule_for(schedule: Schedule, token, role: str, q_len: int, kv_len: int) -> Rule | None:
    """The first rule the token lets through that takes this call (None: no rule does)."""
    joint, indices = token if token is not None else (False, tuple(range(len(schedule.rules))))
    call_kind = kind(role, q_len, kv_len, joint)
    for i in indices:
        if i >= len(schedule.rules):
            break  # the position also matches rules after the schedule's own (sparse dense windows)
        rule = schedule.rules[i]
        if rule.takes(role, call_kind):
            return rule
    return None


# --- the model's blocks -----------------------------------------------------------------------------

#: Attributes of a denoiser that hold its blocks, in the order its forward runs them, and whether
#: the blocks' attention is joint (text and image tokens in one sequence). ``None``: joint when the
#: model's class is in ``JOINT_MODELS``. ldm/sgm UNets (A1111, Forge, ComfyUI) number their input
#: blocks, the middle block and the output blocks as LoRA block weights do (IN00-IN11, M00, OUT00-OUT11
#: for SD1.5: 25 blocks); SD3's MMDiT its joint blocks; Flux, Chroma and HunyuanVideo their double
#: then single blocks; Wan and diffusers' transformers their block lists; diffusers' UNet its down,
#: mid and up blocks.
BLOCK_LISTS = (
    ("input_blocks", False), ("middle_block", False), ("output_blocks", False),
    ("down_blocks", False), ("mid_block", False), ("up_blocks", False),
    ("joint_blocks", True), ("double_blocks", True), ("single_blocks", True),
    ("transformer_blocks", None), ("single_transformer_blocks", True), ("blocks", None),
)
#: Model classes whose ``transformer_blocks`` or ``blocks`` attend jointly (diffusers' SD3 and Flux,
#: Qwen-Image; ComfyUI's Mochi, which concatenates the visual and text tokens in every block).
JOINT_MODELS = ("SD3Transformer2DModel", "FluxTransformer2DModel", "Flux2Transformer2DModel",
                "QwenImageTransformer2DModel", "AsymmDiTJoint")


def block_modules(model) -> list:
    """(module, joint) for each numbered block of ``model``, in forward order; empty when none is known."""
    found = []
    for name, joint in BLOCK_LISTS:
        part = getattr(model, name, None)
        if part is None:
            continue
        if joint is None:
            joint = type(model).__name__ in JOINT_MODELS
        # A middle block is one block however many layers it holds (an nn.Sequential is not a list of blocks).
        found.extend((m, joint) for m in (part if isinstance(part, (torch.nn.ModuleList, list, tuple)) else [part]))
    return found


@contextlib.contextmanager
def blocks(model):
    """While the ``with`` block runs, each numbered block of ``model`` tells ``where`` when it starts
    (a forward pre-hook per block: one Python call per block per model call). Yields the number of
    blocks (0: ``model`` has none this module knows, and block conditions never hold for it).

    A block that is an ``nn.Sequential`` gets the hook on each of its layers too: ComfyUI's UNet runs
    a block's layers one by one (``forward_timestep_embed``) without calling the block itself."""
    found = block_modules(model)
    handles = []
    total = len(found)
    try:
        for i, (module, joint) in enumerate(found):
            starts = _block_hook(i, total, joint)
            layers = list(module) if isinstance(module, torch.nn.Sequential) else []
            for part in (module, *layers):
                hook = getattr(part, "register_forward_pre_hook", None)
                if hook is not None:
                    handles.append(hook(starts))
        yield total
    finally:
        for handle in handles:
            handle.remove()


def _block_hook(index: int, total: int, joint: bool):
    def starts(module, args):
        here = position()
        if here.block != index or here.blocks != total:  # else: the block's next layer
            at_block(index, total, joint)
    return starts
