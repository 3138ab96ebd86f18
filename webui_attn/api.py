"""A read-only JSON route: what can run here and what ran in the last generation.

``GET /flash-attention/v1/status`` returns ``{"availability": …, "tuning": …, "last_report": … or null}``;
the availability part is the data of the Settings table, the tuning part the stored rankings of this
machine, the report that of the readout.
"""
from __future__ import annotations

import lib_attn
from lib_attn import _compat

ROUTE = "/flash-attention/v1/status"


def availability() -> dict:
    """Torch version, the device, each backend (available, version, or why not) and the default chains."""
    device = lib_attn.device_info()
    return {
        "torch": _compat.TORCH_VERSION_TEXT,
        "device": {
            "type": device.type,
            "index": device.index,
            "name": device.name,
            "capability": None if device.capability is None else f"{device.capability[0]}.{device.capability[1]}",
            "total_memory_bytes": device.total_memory,
        },
        "backends": [
            {"id": b.id, "label": b.label, "available": b.available, "version": b.version or None,
             "reason": b.reason or None}
            for b in lib_attn.backends()
        ],
        "default_chains": {role: list(lib_attn.default_chain(role, device)) for role in lib_attn.ROLES},
    }


def tuning() -> dict:
    """The tuning mode, whether it measures on this device, and this machine's stored rankings
    (``lib_attn.tune.table``: the file, the fingerprint, one entry per call signature)."""
    from lib_attn import tune

    device = lib_attn.device_info()
    mode = lib_attn.config().tune
    return dict(tune.table(device), mode=mode, active=tune.enabled(mode, device.type))


def status() -> dict:
    from . import panel

    report = panel.last_report()
    return {"availability": availability(), "tuning": tuning(),
            "last_report": None if report is None else report.to_dict()}


def register(app) -> bool:
    """Add the route to a FastAPI ``app`` once; returns False when it was already there."""
    if app is None:
        return False
    if any(getattr(route, "path", None) == ROUTE for route in getattr(app, "routes", ())):
        return False
    app.add_api_route(ROUTE, status, methods=["GET"], tags=["flash-attention"],
                      summary="Attention backends available here and the last generation's report")
    return True
