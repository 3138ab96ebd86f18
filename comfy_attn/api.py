"""The status route on ComfyUI's server: ``GET /flash-attention/v1/status``, the same answer as on the
webuis (availability, routing, tuning, ``last_report``: the last graph's, with ComfyUI's text of it).

ComfyUI has no login of its own, so the answer holds nothing its UI would not show: no file paths
(the tuning file is named, not placed), no settings of other extensions.
"""
from __future__ import annotations

from webui_attn import api

from . import readout, route, run

ROUTE = api.ROUTE


def status() -> dict:
    return api.status(route=route.routing(), report=run.last_report(), to_json=readout.to_json)


def register(routes) -> bool:
    """Add the route to ComfyUI's ``PromptServer.instance.routes`` (an aiohttp ``RouteTableDef``) once."""
    from aiohttp import web

    if any(getattr(r, "path", None) == ROUTE for r in routes):
        return False

    async def handler(request):
        return web.json_response(status())

    routes.get(ROUTE)(handler)
    return True
