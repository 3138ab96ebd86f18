"""The extension's settings as the webui stores them: their keys, defaults, what a stored value means
(the ``settings`` configuration layer) and what is wrong with one.

The Settings page, the accordion, the status route and the script body all read them here. Values
are read again at every generation, so a change applies to the next one.
"""
from __future__ import annotations

import lib_attn
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES

from host_attn import voice

from . import layers
from .choices import backend_from_choice
from .flags import DENOISER_ROLES, schedule_problem, sparse_problem

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
KEY_SPARSE = PREFIX + "sparse"

DEFAULTS = {KEY_BACKEND: AUTO, KEY_VAE_BACKEND: AUTO, KEY_FP32: AUTO, KEY_STRICT: False, KEY_READOUT: True,
            KEY_TUNE: AUTO, KEY_GUARD: AUTO, KEY_SCHEDULE: "", KEY_SPARSE: ""}
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
    for problem in (setting_schedule_problem(values), setting_sparse_problem(values)):
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


def setting_sparse_problem(values: dict) -> str | None:
    """What is wrong with the stored sparse settings, or None. Such settings are never applied, and a
    generation is refused while they are stored, as for a schedule: it would otherwise run exact (or
    sparse) where the user asked for the other."""
    problem = sparse_problem(values.get(KEY_SPARSE) or None)
    if problem is None:
        return None
    return (f"setting {KEY_SPARSE}: {problem}; not applied, and generations that leave sparse attention to the "
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
    text = str(values.get(KEY_SPARSE) or "").strip()
    if text and setting_sparse_problem(values) is None:
        layer["sparse"] = text
    return layer or None


def apply_settings(opts=None, values: dict | None = None) -> dict:
    """Push the stored settings (or ``values``, as ``read`` gives them) to the engine, each ignored value
    logged once; returns the merged configuration now in force."""
    values = read(opts) if values is None else values
    for message in problems(values):
        voice.log_once(("setting", message), message)
    return layers.set_layer("settings", layer_from(values))


def readout_enabled(opts=None) -> bool:
    return bool(read(opts)[KEY_READOUT])
