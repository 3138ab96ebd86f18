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
from lib_attn.device import cpu_model, default_device
from lib_attn.kernels import REGISTRY
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
             "reason": (reason(b.id, b.reason) if reason is not None else b.reason) or None,
             # a few words for a dropdown label (``flash-attn — needs a GPU``), as the webuis' lists show
             "short_reason": None if b.available else short_reason(b, device.type)}
            for b in lib_attn.backends()
        ],
        "default_chains": {role: list(lib_attn.default_chain(role, device)) for role in lib_attn.ROLES
                           if role in ROUTED_ROLES},
        "chains": {role: list(chain_for(role, device, None, lib_attn.config())[0]) for role in lib_attn.ROLES
                   if role in ROUTED_ROLES},
        "ignored_settings": list(ignored),
    }


# --- what cannot run here, in a user's words -----------------------------------------------------------
#
# The probes' reasons are the import errors' own text, kept whole for ``doctor``, the status route and the
# availability table. Settings, the accordion, the node tooltips and the startup log group them by cause
# instead, each group once, with what a user can do about it.

#: The package a family of backends comes from, by the first distribution its probe looks for: shown
#: once, with its ids when there are several.
FAMILY_NAMES = {"sageattention": "SageAttention", "sageattn3": "SageAttention 3"}
#: The causes in the order they are shown: (key, the group's words).
CAUSES = (
    ("gpu", "need an NVIDIA or AMD GPU"),
    ("missing", "not installed"),
    ("torch", "not in this torch build"),
    ("broken", "installed but does not load (python -m lib_attn doctor says why)"),
)
#: How to install a kernel into a host that has no install step of its own (ComfyUI, InvokeAI).
INSTALL_HINT = "to install, pip install into this Python (docs/installing-kernels.md)"
#: The webuis install kernels at launch from this variable (``install.py``).
WEBUI_INSTALL_HINT = "to install, set ATTN_INSTALL (docs/installing-kernels.md) and restart"
#: Backends that are unavailable by design until something makes them apply: never listed as missing.
SITUATIONAL = ("sdpa-host",)


def cause(info, device_type: str) -> str:
    """Why one backend cannot run here, as one of ``CAUSES``' keys, or its own reason in a few words."""
    reason = info.reason or ""
    backend = REGISTRY.get(info.id)
    if backend is not None and device_type not in backend.devices or reason.startswith("no CUDA device"):
        return "gpu"
    if "No module named" in reason or "is not installed" in reason or "not installed" in reason.split(";")[0]:
        return "missing"
    if "torch build" in reason or reason.startswith("torch ") or "this torch" in reason:
        return "torch"
    if reason.startswith(("ImportError", "OSError", "RuntimeError", "AttributeError")):
        return "broken"
    return one_line_reason(reason)


def one_line_reason(reason: str, limit: int = 60) -> str:
    text = " ".join(reason.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _named(ids: list) -> list[str]:
    """The ids of one cause with each package's family shown once: ``SageAttention (sage, sage-triton)``."""
    families: dict = {}
    for bid in ids:
        backend = REGISTRY.get(bid)
        package = backend.packages[0] if backend is not None and backend.packages else bid
        families.setdefault(FAMILY_NAMES.get(package, package), []).append(bid)
    return [name if members == [name] else f"{name} ({', '.join(members)})" for name, members in families.items()]


def unavailable_groups(device_type: str | None = None, infos=None) -> list[tuple[str, list[str]]]:
    """(the cause in words, the ids and families it holds) for the backends that cannot run here."""
    device_type = device_type or default_device()
    infos = lib_attn.backends() if infos is None else infos
    grouped: dict = {}
    for info in infos:
        if not info.available and info.id not in SITUATIONAL:
            grouped.setdefault(cause(info, device_type), []).append(info.id)
    words = dict(CAUSES)
    ordered = [key for key, _ in CAUSES if key in grouped] + [key for key in grouped if key not in words]
    out = []
    for key in ordered:
        if key in words:
            out.append((words[key], _named(grouped[key])))
        else:  # a reason of its own: each id says it
            out.extend((key, [bid]) for bid in grouped[key])
    return out


def unavailable_text(install: str = INSTALL_HINT, device_type: str | None = None, infos=None) -> str:
    """The backends that cannot run here, grouped by cause, each group with what to do (plain text, for a
    dropdown's info line, a tooltip or the startup log): ``Not available here: need an NVIDIA or AMD GPU:
    flash-attn, …; not installed: xformers — see …``. ``install``: how this host installs one."""
    parts, causes = [], dict(CAUSES).values()
    for words, names in unavailable_groups(device_type, infos):
        text = f"{words}: {', '.join(names)}" if words in causes else f"{names[0]} ({words})"
        parts.append(f"{text} — {install}" if words == "not installed" else text)
    return "Not available here: " + "; ".join(parts) + "." if parts else "Every backend is available here."


def short_reason(info, device_type: str | None = None) -> str:
    """A few words on why one backend cannot run here, for its dropdown label: ``not installed``."""
    key = cause(info, device_type or default_device())
    return {"gpu": "needs a GPU", "missing": "not installed", "torch": "not in this torch",
            "broken": "does not load"}.get(key, "unavailable")


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
