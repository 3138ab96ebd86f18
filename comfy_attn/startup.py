"""What happens when ComfyUI loads this package: the status route, and the global route when asked for.

The global route is asked for by ``ATTN_COMFY_ROUTE`` (``auto``, or a chain of backend ids such as
``flash-attn,sdpa-cudnn``; empty, ``0`` or ``off``: no global route), or by ComfyUI's own
``--use-flash-attention`` / ``--use-sage-attention`` (``host_attn.startup_flags``: ComfyUI would stop
at startup where such a flag's package is missing; this package lets it start, and every model runs
on the engine with that kernel first, falling back per call with the reason).

``ATTN_COMFY_SCHEDULE`` is the default schedule (``lib_attn.schedule``'s one-line text): the global
route's, and that of every Attention backend node whose schedule is empty. ``ATTN_COMFY_SPARSE`` is
the default sparse attention (``lib_attn.sparse``'s one-line text, e.g. ``sol, budget=0.15``) in the same
way. A value that does not parse is said at startup, naming what is wrong, and not used at all.
"""
from __future__ import annotations

import os

import lib_attn

from lib_attn.config import parse_ids

from host_attn import startup_flags, voice

from . import route

ENV_ROUTE = "ATTN_COMFY_ROUTE"
ENV_SCHEDULE = "ATTN_COMFY_SCHEDULE"
ENV_SPARSE = "ATTN_COMFY_SPARSE"
OFF = ("", "0", "off", "false", "no")


def requested(environ=os.environ, args=None) -> tuple[list[str] | None, list[str]]:
    """(the chain asked for, None for Auto; what asked for it), or (None, []) when no global route is.
    ValueError names an unknown id in ``ATTN_COMFY_ROUTE`` and the valid ones."""
    why, chain = [], []
    value = environ.get(ENV_ROUTE, "").strip()
    if value.lower() not in OFF:
        why.append(f"{ENV_ROUTE}={value}")
        if value.lower() not in ("auto", "on", "1", "true", "yes"):
            chain, unknown = parse_ids(value)
            if unknown:
                raise ValueError(f"{ENV_ROUTE}={value!r}: unknown backend id {', '.join(map(repr, unknown))}; "
                                 f"valid: auto or ids of {', '.join(lib_attn.BACKEND_IDS)}")
    for spelling, backend in startup_flags.given(args, environ):
        why.append(spelling)
        if backend and backend not in chain:
            chain.append(backend)
    if not why:
        return None, []
    return chain or None, why


def start(routes=None, args=None) -> list[str]:
    """Register the status route on ``routes`` (ComfyUI's), and route every model when asked for;
    returns what the global route routed (empty without it)."""
    from . import api

    if routes is not None:
        try:
            api.register(routes)
        except ImportError as exc:  # aiohttp comes with ComfyUI; a bare test process may lack it
            voice.log_once(("comfy-route", str(exc)), f"status route not added: {exc}")
    default_schedule()
    default_sparse()
    try:
        chain, why = requested(args=args)
    except ValueError as exc:
        voice.log_once(("comfy-env", str(exc)), f"{exc}. No global route; the nodes still work.")
        return []
    if not why:
        return []
    config = {"preference": {"unet": chain, "dit": chain}} if chain else None
    routed = route.route_everything(config)
    first = f"{chain[0]} first, " if chain else ""
    voice.log_once(("comfy-global", tuple(routed)),
                  f"{' and '.join(why)}: every model's attention runs on this extension's engine ({first}falling "
                  f"back per call, with the reason in the report): {', '.join(routed) or 'nothing loaded yet'}")
    return routed


def default_schedule(environ=os.environ):
    """Put ``ATTN_COMFY_SCHEDULE`` in force; returns the schedule, or None when none is set or it does
    not parse (then the startup log says which rule and part are wrong, and nothing of it is used)."""
    return _default(environ, ENV_SCHEDULE, "schedule", "the nodes' schedules still work")


def default_sparse(environ=os.environ):
    """Put ``ATTN_COMFY_SPARSE`` in force; returns the sparse settings, or None when none are set or they
    do not parse (then the startup log names the value that is wrong, and nothing of it is used)."""
    return _default(environ, ENV_SPARSE, "sparse", "the nodes' sparse settings still work")


def _default(environ, variable: str, field: str, meanwhile: str):
    text = environ.get(variable, "").strip()
    if not text:
        return None
    try:
        lib_attn.configure(**{field: text}, hosted=True)
    except ValueError as exc:
        voice.log_once((f"comfy-{field}", text), f"{variable}={text!r}: {exc}. No default {field}; {meanwhile}.")
        return None
    value = getattr(lib_attn.config(), field)
    if value is not None:
        voice.log_once((f"comfy-{field}", text), f"{variable}: default {field} {value.text!r}")
    return value
