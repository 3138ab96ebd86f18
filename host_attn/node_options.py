"""What a host's node asks the user for (a backend, a chain typed by hand, strict, fp32, tuning, the
guard, a schedule, sparse attention) and the engine configuration it makes of the answers; ComfyUI's and InvokeAI's
nodes share it, each with its own way of showing the choices and refusing a bad value.
"""
from __future__ import annotations

import lib_attn
from lib_attn import schedule as schedules
from lib_attn import sparse as sparse_settings
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES
from lib_attn.config import parse_ids

from .status import unavailable_text

AUTO = "auto"


def backend_choices() -> list[str]:
    return [AUTO, *lib_attn.BACKEND_IDS]


def parse_chain(backend: str, chain: str) -> list[str] | None:
    """The chain a node asks for: ``chain`` (comma-separated ids) when given, else ``backend``; None
    for Auto. ValueError names an unknown id and the valid ones."""
    text = (chain or "").strip() or ("" if backend == AUTO else backend)
    ids, unknown = parse_ids(text)
    if unknown:
        raise ValueError(f"unknown backend id {', '.join(map(repr, unknown))}; valid ids: "
                         f"{', '.join(lib_attn.BACKEND_IDS)} (or leave the chain empty for Auto)")
    return ids or None


def config_for(roles, backend: str, chain: str, strict: bool, fp32: str, tune: str = AUTO,
               guard: str | None = None, schedule: str = "", sparse: str = "") -> dict:
    """``lib_attn.configure`` arguments for the roles a node routes; ValueError for a bad value.
    ``guard`` None leaves the guard's mode in force; an empty ``schedule`` the schedule in force
    (the host's default schedule, if any), ``off`` none; an empty ``sparse`` the sparse settings in force,
    ``off`` none."""
    if fp32 not in (AUTO, *FP32_POLICIES):
        raise ValueError(f"fp32 {fp32!r} is not one of {AUTO}, {', '.join(FP32_POLICIES)}")
    if tune not in TUNE_MODES:
        raise ValueError(f"tune {tune!r} is not one of {', '.join(TUNE_MODES)}")
    if guard is not None and guard not in GUARD_MODES:
        raise ValueError(f"guard {guard!r} is not one of {', '.join(GUARD_MODES)}")
    ids = parse_chain(backend, chain)
    config = {"preference": {role: ids for role in roles} if ids else "auto", "strict": bool(strict), "tune": tune}
    if fp32 != AUTO:
        config["fp32"] = fp32
    if guard is not None:
        config["guard"] = guard
    if (schedule or "").strip():
        config["schedule"] = schedules.parse(schedule) or ""
    if (sparse or "").strip():
        config["sparse"] = sparse_settings.parse(sparse) or ""
    return config


def problem(chain, schedule="", sparse="") -> str | None:
    """What is wrong with a chain, a schedule or sparse settings typed by hand, or None (a value linked
    from another node arrives as None: it is checked when the node runs)."""
    found = problems(chain=chain, schedule=schedule, sparse=sparse)
    return next(iter(found.values()), None)


#: Each input a node checks before the graph runs, with its parser.
_PARSERS = {
    "chain": lambda text: parse_chain(AUTO, text),
    "schedule": lambda text: schedules.parse(text or None),
    "sparse": lambda text: sparse_settings.parse(text or None),
}


def problems(**values) -> dict[str, str]:
    """What is wrong with each of ``values`` (``chain``, ``schedule``, ``sparse``: text typed by hand), by
    input name, in that order; a value linked from another node arrives as None and is checked when the
    node runs."""
    found = {}
    for name, text in values.items():
        if text is None:
            continue
        try:
            _PARSERS[name](text)
        except ValueError as exc:
            found[name] = str(exc)
    return found


def backend_tooltip() -> str:
    """What Auto and an id mean, and which backends cannot run here."""
    return ("Auto: the fastest backend that takes each call; a backend id: that one first, falling back per "
            "call. " + unavailable_text())


CHAIN_TOOLTIP = ("Optional: a chain of backend ids tried in order per call, e.g. flash-attn,sdpa-cudnn "
                 "(overrides backend)")
STRICT_TOOLTIP = "Stop the run instead of falling back when the first backend cannot take a call"
FP32_TOOLTIP = "fp32 inputs: cast (half-precision kernels, result cast back) or keep (fp32 kernels only)"
TUNE_TOOLTIP = ("Measure the backends that take each call kind on its first call and run the fastest "
                "(auto: on CUDA GPUs)")
GUARD_TOOLTIP = ("on: each kernel's first call of each kind is checked against a reference, then its output is "
                 "watched for NaN/inf; a faulty call is recomputed on the next backend. full: every call checked "
                 "(slower, to find what makes a black image). off: nothing checked")


def schedule_tooltip(default_variable: str) -> str:
    return ("Optional: which backends serve which calls, as rules 'conditions: backends' separated by ';', the "
            "first rule that holds taking the call, e.g. 'cross: sdpa; 0-20%: sdpa; 20-80%: sage3, sage; 80-100%: "
            "sdpa'. Conditions: A-B% (this sampler's steps done), sigma X-Y, self, cross, joint, first N, last N, "
            f"blocks A-B. Calls no rule takes use the backend and chain above. Empty: the default schedule "
            f"({default_variable}) if one is set; off: none.")


def sparse_tooltip(default_variable: str) -> str:
    return ("Optional: sparse attention for long self-attention calls, held to an error budget: a method ("
            f"{', '.join(sparse_settings.methods())}) then name=value fields, e.g. '{sparse_settings.EXAMPLE}'. "
            "budget: the largest relative error of a call against exact attention, in (0, 1]; min_tokens: "
            "shorter calls stay dense; topk (a keep fraction) or threshold (the method's own); dense: windows "
            f"that stay dense (schedule conditions). Empty: the default ({default_variable}) if one is set; "
            "off: none.")
