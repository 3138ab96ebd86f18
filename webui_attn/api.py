"""A read-only JSON route: what can run here and what ran in the last generation.

``GET /flash-attention/v1/status`` returns ``{"availability": …, "routing": …, "tuning": …, "guard": …,
"last_report": … or null}``; the availability part is the data of the Settings table, ``routing``
whether attention goes through the extension now (and if not, what runs it), the tuning part the stored
rankings of this machine (the tuning file by name, never its path), ``guard`` the guard's mode and the
output check failures remembered here, the report that of the readout.

The route describes this machine, so it answers only whom the webui's own API would answer: with
``--api-auth`` its credentials, with ``--gradio-auth`` (and no API auth) the UI's; see ``auth``.
"""
from __future__ import annotations

import os

from . import readout, state

ROUTE = "/flash-attention/v1/status"
_WEBUI = object()  # the webui's own routing and last report


def tuning() -> dict:
    """``state.tuning()`` with the file named, not placed: the route never reveals a path."""
    data = state.tuning()
    return dict(data, file=os.path.basename(data["file"]))


def status(route=_WEBUI, report=_WEBUI, to_json=readout.to_json) -> dict:
    """The route's answer; ``route``, ``report`` and ``to_json`` are the webui's unless a host (ComfyUI)
    gives its own routing, last report (or None) and text."""
    report = state.last_report() if report is _WEBUI else report
    route = state.routing() if route is _WEBUI else route
    return {"availability": state.availability(),
            "routing": {"routed": route.routed, "ran_on": route.ran_on, "hint": route.hint},
            "tuning": tuning(),
            "guard": state.guard(),
            "last_report": None if report is None else to_json(report)}


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
