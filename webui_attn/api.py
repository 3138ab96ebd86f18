"""A read-only JSON route: what can run here and what ran in the last generation.

``GET /flash-attention/v1/status`` returns ``{"availability": …, "routing": …, "tuning": …,
"last_report": … or null}``; the availability part is the data of the Settings table, ``routing``
whether attention goes through the extension now (and if not, what runs it), the tuning part the stored
rankings of this machine, the report that of the readout.
"""
from __future__ import annotations

import sys

import lib_attn
from lib_attn import _compat
from lib_attn.device import cpu_model


ROUTE = "/flash-attention/v1/status"
#: Roles the hosts send through the engine; neither sends its text encoder.
ROUTED_ROLES = ("unet", "dit", "vae")
XFORMERS_BLOCKED = "A1111 blocks importing xformers unless it is started with --xformers"


def device_name(device) -> str:
    return f"CPU ({cpu_model()})" if device.type == "cpu" else device.name


def _reason(backend_id: str, reason: str | None) -> str | None:
    """The engine's reason, with the host's part in it named (A1111's import hook puts None in
    ``sys.modules["xformers"]`` unless the webui was started with --xformers)."""
    if backend_id == "xformers" and reason and "xformers" in sys.modules and sys.modules["xformers"] is None:
        return f"{XFORMERS_BLOCKED} ({reason})"
    return reason or None


def availability(device=None) -> dict:
    """Torch version, the device, each backend (available, version, or why not), the default chains of the
    roles the hosts route, and the stored settings being ignored.

    ``device`` (a ``DeviceInfo``) describes another device than this machine's (tests, docs)."""
    from . import settings

    device = device or lib_attn.device_info()
    return {
        "torch": _compat.TORCH_VERSION_TEXT,
        "device": {
            "type": device.type,
            "index": device.index,
            "name": device_name(device),
            "capability": None if device.capability is None else f"{device.capability[0]}.{device.capability[1]}",
            "total_memory_bytes": device.total_memory,
            "platform": device.platform,
            "arch": device.arch or None,
            "hip": device.hip,
            "miopen": device.miopen,
        },
        "backends": [
            {"id": b.id, "label": b.label, "available": b.available, "version": b.version or None,
             "reason": _reason(b.id, b.reason)}
            for b in lib_attn.backends()
        ],
        "default_chains": {role: list(lib_attn.default_chain(role, device)) for role in lib_attn.ROLES
                           if role in ROUTED_ROLES},
        "ignored_settings": settings.problems(settings.read(settings._shared_opts())),
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
    route = panel.routing()
    return {"availability": availability(),
            "routing": {"routed": route.routed, "ran_on": route.ran_on, "hint": route.hint},
            "tuning": tuning(),
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
