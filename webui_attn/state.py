"""What the UI, the API and the generation hooks all read: the extension's stored settings as values,
the last generation's report, whether attention is routed here, and what can run on this machine.

Everything else in ``webui_attn`` reads from this module and nothing here reads from them, so the
settings page, the accordion, the status route and the script body never import each other in a
circle. Values are read again at every generation, so a change applies to the next one.
"""
from __future__ import annotations

import importlib.machinery
import sys
import threading

import lib_attn
from lib_attn import _compat
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES
from lib_attn.device import cpu_model
from lib_attn.chains import chain_for
from lib_attn.report import Report

from . import host, hosts, layers
from .choices import backend_from_choice
from .flags import DENOISER_ROLES, schedule_problem

# --- the settings: keys, defaults, what a stored value means ---------------------------------------

PREFIX = "flash_attn_"
AUTO = "Auto"

KEY_BACKEND = PREFIX + "backend"
KEY_VAE_BACKEND = PREFIX + "vae_backend"
KEY_FP32 = PREFIX + "fp32"
KEY_STRICT = PREFIX + "strict"
KEY_READOUT = PREFIX + "readout"
KEY_AVAILABILITY = PREFIX + "availability"
KEY_TUNE = PREFIX + "tune"
KEY_GUARD = PREFIX + "guard"
KEY_SCHEDULE = PREFIX + "schedule"

DEFAULTS = {KEY_BACKEND: AUTO, KEY_VAE_BACKEND: AUTO, KEY_FP32: AUTO, KEY_STRICT: False, KEY_READOUT: True,
            KEY_TUNE: AUTO, KEY_GUARD: AUTO, KEY_SCHEDULE: ""}
FP32_CHOICES = (AUTO, *FP32_POLICIES)
TUNE_CHOICES = (AUTO, "on", "off")
GUARD_CHOICES = (AUTO, *GUARD_MODES)


def backend_choices() -> list[str]:
    """Dropdown values: "Auto" then every backend id, available or not (stable values for config.json)."""
    return [AUTO, *lib_attn.BACKEND_IDS]


def shared_opts():
    """The webui's ``shared.opts``, or None outside a webui (or before it made them)."""
    try:
        from modules import shared
    except ImportError:
        return None
    return getattr(shared, "opts", None)


def read(opts=None) -> dict:
    """The extension's values from ``opts`` (the webui's when None; defaults for keys the host has not
    registered yet)."""
    if opts is None:
        opts = shared_opts()
    out = {}
    for key, default in DEFAULTS.items():
        value = getattr(opts, key, None) if opts is not None else None
        out[key] = default if value is None else value
    return out


def problems(values: dict) -> list[str]:
    """One message per stored value that is ignored, naming the setting, the value and the valid ones."""
    out = []
    for key in (KEY_BACKEND, KEY_VAE_BACKEND):
        value = values.get(key)
        if value not in (None, AUTO) and backend_from_choice(value) is None:
            out.append(f"setting {key}={value!r} ignored (not a backend id), {AUTO} used; valid: "
                       f"{', '.join(backend_choices())}")
    fp32 = values.get(KEY_FP32)
    if fp32 is not None and fp32 not in FP32_CHOICES:
        out.append(f"setting {KEY_FP32}={fp32!r} ignored, {AUTO} used; valid: {', '.join(FP32_CHOICES)}")
    guard = values.get(KEY_GUARD)
    if guard is not None and guard not in GUARD_CHOICES:
        out.append(f"setting {KEY_GUARD}={guard!r} ignored, {AUTO} used; valid: {', '.join(GUARD_CHOICES)}")
    problem = setting_schedule_problem(values)
    if problem:
        out.append(problem)
    return out


def setting_schedule_problem(values: dict) -> str | None:
    """What is wrong with the stored schedule (the message ``problems`` lists), or None. Such a schedule
    is never applied, and a generation is refused while it is stored (``panel.process``): its steps
    would otherwise run on other kernels than the ones the user wrote down."""
    problem = schedule_problem(values.get(KEY_SCHEDULE) or None)
    if problem is None:
        return None
    return (f"setting {KEY_SCHEDULE}: {problem}; not applied, and generations that leave the schedule to the "
            f"setting are refused until it is corrected or emptied")


def layer_from(values: dict) -> dict | None:
    """The ``settings`` layer for ``read()``'s values; None when every value is left to Auto/off.

    A role set here replaces that role's chain; roles left on Auto keep what the weaker layers say.
    A stored dropdown label names its id too; a value that names no backend is Auto (``problems``).
    """
    backend, vae = backend_from_choice(values.get(KEY_BACKEND)), backend_from_choice(values.get(KEY_VAE_BACKEND))
    layer = {}
    if backend or vae:
        layer["preference"] = {role: [backend] for role in DENOISER_ROLES if backend}
        if vae:
            layer["preference"]["vae"] = [vae]
    fp32 = values.get(KEY_FP32)
    if fp32 in FP32_POLICIES:
        layer["fp32"] = fp32
    if values.get(KEY_STRICT):
        layer["strict"] = True
    if values.get(KEY_TUNE) in TUNE_MODES and values.get(KEY_TUNE) != "auto":
        layer["tune"] = values[KEY_TUNE]
    if values.get(KEY_GUARD) in GUARD_MODES:
        layer["guard"] = values[KEY_GUARD]
    text = str(values.get(KEY_SCHEDULE) or "").strip()
    if text and setting_schedule_problem(values) is None:
        layer["schedule"] = text
    return layer or None


def apply_settings(opts=None) -> dict:
    """Push the stored settings to the engine (each ignored value logged once); returns the merged
    configuration now in force."""
    values = read(opts)
    for message in problems(values):
        host.log_once(("setting", message), message)
    return layers.set_layer("settings", layer_from(values))


def readout_enabled(opts=None) -> bool:
    return bool(read(opts)[KEY_READOUT])


# --- the last generation ----------------------------------------------------------------------------

_lock = threading.Lock()
_last: Report | None = None


def last_report() -> Report | None:
    """The report of the last finished generation, or None."""
    return _last


def set_last_report(report: Report | None) -> None:
    global _last
    with _lock:
        _last = report


def routing() -> host.Routing:
    """Whether attention goes through this extension in the running host, from its adapter."""
    running = hosts.detect()
    adapter = hosts.adapter(running)
    if adapter is None:
        return host.Routing(False, f"the webui's own attention ({running.name}: {UNRECOGNISED})")
    return adapter.routing()


UNRECOGNISED = "none of A1111, Forge, Forge Neo, reForge or Forge Classic recognised"

# --- what can run here --------------------------------------------------------------------------------

#: Roles the hosts send through the engine; none sends its text encoder.
ROUTED_ROLES = ("unet", "dit", "vae")
XFORMERS_MISSING = "xformers is not installed"


def xformers_blocked(host_name: str) -> str:
    return f"{host_name} blocks importing xformers unless it is started with --xformers"


def device_name(device) -> str:
    return f"CPU ({cpu_model()})" if device.type == "cpu" else device.name


def _reason(backend_id: str, reason: str | None) -> str | None:
    """The engine's reason, with the host's part in it named: A1111 and the webuis built on it put None in
    ``sys.modules["xformers"]`` unless started with --xformers, which matters only where xformers is
    installed (found on the path, past that None)."""
    if backend_id == "xformers" and reason and "xformers" in sys.modules and sys.modules["xformers"] is None:
        if importlib.machinery.PathFinder.find_spec("xformers") is None:
            return XFORMERS_MISSING
        running = hosts.detect()
        return f"{xformers_blocked('the webui' if running == hosts.NONE else running.name)} ({reason})"
    return reason or None


def availability(device=None) -> dict:
    """Torch version, the device, each backend (available, version, or why not), the default chains of the
    roles the hosts route and the chains in force, and the stored settings being ignored.

    ``device`` (a ``DeviceInfo``) describes another device than this machine's (tests, docs)."""
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
        # What the flags, the host's own flags and the settings make of it (before a per-generation override).
        "chains": {role: list(chain_for(role, device, None, lib_attn.config())[0]) for role in lib_attn.ROLES
                   if role in ROUTED_ROLES},
        "ignored_settings": problems(read()),
    }


def guard() -> dict:
    """The guard's mode and the output check failures this machine remembers (``tuning_file.remembered``)."""
    from lib_attn import tuning_file

    return {"mode": lib_attn.config().guard, "rejected": tuning_file.remembered(lib_attn.device_info())}


def tuning() -> dict:
    """The tuning mode, whether it measures on this device, and this machine's stored rankings
    (``tuning_file.table``: the file, the fingerprint, one entry per call signature)."""
    from lib_attn import tune, tuning_file

    device = lib_attn.device_info()
    mode = lib_attn.config().tune
    return dict(tuning_file.table(device), mode=mode, active=tune.enabled(mode, device.type))
