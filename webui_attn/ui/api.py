"""The status route on the webuis: ``GET /flash-attention/v1/status`` (``host_attn.status``), with the
webuis' parts: the reasons their own xformers switch gives, the stored settings being ignored, the
routing of the running webui and the last generation's report in their text.

The route describes this machine, so it answers only whom the webui's own API would answer: with
``--api-auth`` its credentials, with ``--gradio-auth`` (and no API auth) the UI's; see ``auth``.
"""
from __future__ import annotations

import importlib.machinery
import sys

from host_attn import status as host_status

from ..routing import detect
from ..settings import stored
from . import readout

ROUTE = host_status.ROUTE
XFORMERS_MISSING = "xformers is not installed"


def xformers_blocked(host_name: str) -> str:
    return f"{host_name} blocks importing xformers unless it is started with --xformers"


def _reason(backend_id: str, reason: str | None) -> str | None:
    """The engine's reason, with the webui's part in it named: A1111 and the webuis built on it put None in
    ``sys.modules["xformers"]`` unless started with --xformers, which matters only where xformers is
    installed (found on the path, past that None)."""
    if backend_id == "xformers" and reason and "xformers" in sys.modules and sys.modules["xformers"] is None:
        if importlib.machinery.PathFinder.find_spec("xformers") is None:
            return XFORMERS_MISSING
        running = detect.detect()
        return f"{xformers_blocked('the webui' if running == detect.NONE else running.name)} ({reason})"
    return reason or None


def availability(device=None) -> dict:
    """``host_status.availability`` with the webui's reasons and its ignored settings; ``device`` (a
    ``DeviceInfo``) describes another device than this machine's (tests, docs)."""
    return host_status.availability(device, _reason, stored.problems(stored.read()))


def status() -> dict:
    """The route's answer on a webui."""
    report = readout.last_report()
    return host_status.answer(availability(), detect.routing(), None if report is None else readout.to_json(report))


def register(app, cmd_opts=None) -> bool:
    """Add the route to a FastAPI ``app`` once, behind the webui's own credentials (``cmd_opts``: the
    webui's flags, read for ``--api-auth`` / ``--gradio-auth``); returns False when it was already there."""
    if app is None:
        return False
    if any(getattr(route, "path", None) == ROUTE for route in getattr(app, "routes", ())):
        return False
    from . import auth

    app.add_api_route(ROUTE, lambda: status(), methods=["GET"], tags=["flash-attention"],
                      summary="Attention backends available here and the last generation's report",
                      dependencies=auth.dependencies(cmd_opts))
    return True
