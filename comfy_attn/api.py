"""The status route on ComfyUI's server: ``GET /flash-attention/v1/status``, the same answer as on the
webuis (``host_attn.status``), with ComfyUI's routing and ``last_report``: the last graph's, in the
plain lines of ``lib_attn.readout``.

ComfyUI has no login of its own, so the answer holds nothing its UI would not show: no file paths
(the tuning file is named, not placed), no settings of other extensions.
"""
from __future__ import annotations

from lib_attn import readout
from host_attn import status as host_status

from . import route, run

ROUTE = host_status.ROUTE


def status() -> dict:
    report = run.last_report()
    return host_status.answer(host_status.availability(), route.routing(),
                              None if report is None else readout.to_json(report))


def register(routes) -> bool:
    """Add the route to ComfyUI's ``PromptServer.instance.routes`` (an aiohttp ``RouteTableDef``) once."""
    from aiohttp import web

    if any(getattr(r, "path", None) == ROUTE for r in routes):
        return False

    async def handler(request):
        return web.json_response(status())

    routes.get(ROUTE)(handler)
    return True
