"""The status route's answer, the same on every host: ``GET /flash-attention/v1/status``.

``answer`` gives ``{"availability": …, "routing": …, "tuning": …, "guard": …, "last_report": …}``:
what can run on this machine (``availability``: torch, the device, each backend with its version or
why not, the default chains and the chains in force), whether attention goes through the engine now
(and if not, what runs it), the stored tuning of this machine with the tuning file named, never
placed, the guard's mode and the output check failures remembered here, and the last report as the
host shows it (``readout.to_json`` or the host's own). The route describes this machine, so each host
serves it behind its own credentials, where it has any.
"""
from __future__ import annotations

import os

import lib_attn
from lib_attn import _compat, tune, tuning_file
from lib_attn.chains import chain_for
from lib_attn.device import cpu_model
from lib_attn.kernels import sdpa as sdpa_kernels

ROUTE = "/flash-attention/v1/status"
#: Roles the hosts send through the engine; none sends its text encoder.
ROUTED_ROLES = ("unet", "dit", "vae")


def device_name(device) -> str:
    return f"CPU ({cpu_model()})" if device.type == "cpu" else device.name


def availability(device=None, reason=None, ignored=()) -> dict:
    """Torch version, the device, each backend (available, version, or why not), the default chains of
    the roles the hosts route and the chains in force (before a per-generation choice), and
    ``ignored``: the host's stored settings being ignored, each with why; ``sdpa_replaced_by``: what
    replaced ``F.scaled_dot_product_attention`` here, or None.

    ``device`` (a ``DeviceInfo``) describes another device than this machine's (tests, docs);
    ``reason(backend_id, engine_reason)`` puts the host's part in a backend's reason."""
    device = device or lib_attn.device_info()
    replaced = sdpa_kernels.replacement()
    return {
        "torch": _compat.TORCH_VERSION_TEXT,
        # A host or extension's function in place of F.scaled_dot_product_attention: sdpa still runs
        # PyTorch's own, sdpa-host the replacement.
        "sdpa_replaced_by": None if replaced is None else sdpa_kernels.callable_name(replaced),
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
             "reason": (reason(b.id, b.reason) if reason is not None else b.reason) or None}
            for b in lib_attn.backends()
        ],
        "default_chains": {role: list(lib_attn.default_chain(role, device)) for role in lib_attn.ROLES
                           if role in ROUTED_ROLES},
        "chains": {role: list(chain_for(role, device, None, lib_attn.config())[0]) for role in lib_attn.ROLES
                   if role in ROUTED_ROLES},
        "ignored_settings": list(ignored),
    }


def unavailable_text() -> str:
    """The backends that cannot run here, each with its reason (plain text, for a dropdown's info line)."""
    missing = [f"{b.id} ({b.reason})" for b in lib_attn.backends() if not b.available]
    return "Not available here: " + "; ".join(missing) if missing else "Every backend is available here."


def guard() -> dict:
    """The guard's mode and the output check failures this machine remembers (``tuning_file.remembered``)."""
    return {"mode": lib_attn.config().guard, "rejected": tuning_file.remembered(lib_attn.device_info())}


def tuning() -> dict:
    """The tuning mode, whether it measures on this device, and this machine's stored rankings
    (``tuning_file.table``: the file, the fingerprint, one entry per call signature)."""
    device = lib_attn.device_info()
    mode = lib_attn.config().tune
    return dict(tuning_file.table(device), mode=mode, active=tune.enabled(mode, device.type))


def answer(availability_data: dict, routing, report_json: dict | None) -> dict:
    """The route's answer: ``routing`` is the host's ``voice.Routing``; ``report_json`` the last report
    as the host shows it, or None before the first."""
    table = tuning()
    return {"availability": availability_data,
            "routing": {"routed": routing.routed, "ran_on": routing.ran_on, "hint": routing.hint},
            "tuning": dict(table, file=os.path.basename(table["file"])),
            "guard": guard(),
            "last_report": report_json}
