"""The extension's settings in Settings > Optimizations, and the ``settings`` configuration layer.

Every key starts with ``flash_attn_``. Values are read again at every generation (and pushed at once
by each option's onchange), so a change applies to the next generation without a restart. "Auto"
leaves the choice to the weaker layers: command-line flags, the A1111 optimizer, the engine default.
"""
from __future__ import annotations

import html

import lib_attn
from lib_attn.config import FP32_POLICIES, TUNE_MODES

from . import layers
from .flags import DENOISER_ROLES

SECTION = ("optimizations", "Optimizations", "sd")
PREFIX = "flash_attn_"
AUTO = "Auto"

KEY_BACKEND = PREFIX + "backend"
KEY_VAE_BACKEND = PREFIX + "vae_backend"
KEY_FP32 = PREFIX + "fp32"
KEY_STRICT = PREFIX + "strict"
KEY_READOUT = PREFIX + "readout"
KEY_AVAILABILITY = PREFIX + "availability"
KEY_TUNE = PREFIX + "tune"

DEFAULTS = {KEY_BACKEND: AUTO, KEY_VAE_BACKEND: AUTO, KEY_FP32: AUTO, KEY_STRICT: False, KEY_READOUT: True,
            KEY_TUNE: AUTO}
FP32_CHOICES = (AUTO, *FP32_POLICIES)
TUNE_CHOICES = (AUTO, "on", "off")


def backend_choices() -> list[str]:
    """Dropdown values: "Auto" then every backend id, available or not (stable values for config.json)."""
    return [AUTO, *lib_attn.BACKEND_IDS]


def unavailable_text() -> str:
    """The backends that cannot run here, each with its reason, as HTML for the dropdowns' info line."""
    missing = [f"{b.id} ({html.escape(b.reason)})" for b in lib_attn.backends() if not b.available]
    return "Not available here: " + "; ".join(missing) if missing else "Every backend is available here."


def _choice_labels() -> list:
    """Choices as (label, value) where gradio takes pairs (4.x): unavailable ids carry their reason."""
    out = [(AUTO, AUTO)]
    for b in lib_attn.backends():
        out.append((b.id if b.available else f"{b.id} — unavailable: {b.reason}", b.id))
    return out


def _dropdown_args():
    from . import ui

    choices = _choice_labels() if ui.gradio_major() >= 4 else backend_choices()
    return {"choices": choices}


def read(opts) -> dict:
    """The extension's values from ``opts`` (defaults for keys the host has not registered yet)."""
    out = {}
    for key, default in DEFAULTS.items():
        value = getattr(opts, key, None) if opts is not None else None
        out[key] = default if value is None else value
    return out


def _backend_id(value) -> str | None:
    """A setting's backend id, or None for Auto and for a value that is no backend id (stale config)."""
    value = str(value or "").strip()
    return value if value in lib_attn.BACKEND_IDS else None


def layer_from(values: dict) -> dict | None:
    """The ``settings`` layer for ``read()``'s values; None when every value is left to Auto/off.

    A role set here replaces that role's chain; roles left on Auto keep what the weaker layers say.
    """
    backend, vae = _backend_id(values.get(KEY_BACKEND)), _backend_id(values.get(KEY_VAE_BACKEND))
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
    return layer or None


def apply(opts=None) -> dict:
    """Push the current settings to the engine; returns the merged configuration now in force."""
    if opts is None:
        opts = _shared_opts()
    return layers.set_layer("settings", layer_from(read(opts)))


def readout_enabled(opts=None) -> bool:
    if opts is None:
        opts = _shared_opts()
    return bool(read(opts)[KEY_READOUT])


def _shared_opts():
    try:
        from modules import shared
    except ImportError:
        return None
    return getattr(shared, "opts", None)


def _on_change():
    apply()


def options(shared) -> dict:
    """The ``OptionInfo`` entries, keyed by option name, stamped with the Optimizations section."""
    import gradio as gr

    from . import ui

    OptionInfo = shared.OptionInfo
    unavailable = unavailable_text()
    entries = {
        KEY_BACKEND: OptionInfo(AUTO, "Attention backend for the UNet / DiT (flash-attention extension)",
                                gr.Dropdown, _dropdown_args, onchange=_on_change)
        .info("Auto: the command-line flag or chosen optimizer if any, else the fastest that can take each call. "
              + unavailable),
        KEY_VAE_BACKEND: OptionInfo(AUTO, "Attention backend for the VAE", gr.Dropdown, _dropdown_args,
                                    onchange=_on_change)
        .info("The VAE attends over one head of 512 channels, which flash-attn and SageAttention cannot take."),
        KEY_FP32: OptionInfo(AUTO, "fp32 attention inputs", gr.Radio, {"choices": list(FP32_CHOICES)},
                             onchange=_on_change)
        .info("cast: run half-only kernels in bf16/fp16 and cast the output back; keep: only kernels that take fp32"),
        KEY_STRICT: OptionInfo(False, "Strict: stop the generation when a chosen backend cannot take a call",
                               gr.Checkbox, onchange=_on_change),
        KEY_TUNE: OptionInfo(AUTO, "Tune: measure the kernels that can take each call kind and run the fastest",
                             gr.Radio, {"choices": list(TUNE_CHOICES)}, onchange=_on_change)
        .info("Auto: the --attn-tune flag, else on for CUDA GPUs. The first call of each kind times every "
              "candidate and checks its output; results are kept across restarts. off: the fixed order. "
              "Clear stored results with: python -m lib_attn tune --clear"),
        KEY_READOUT: OptionInfo(True, "Show which attention kernels ran, their fallbacks, time and VRAM under the image",
                                gr.Checkbox),
    }
    table = ui.availability_option(shared)
    if table is not None:
        entries[KEY_AVAILABILITY] = table
    section = getattr(shared, "options_section", None)
    if section is not None:
        return section(SECTION, entries)
    for info in entries.values():
        info.section = SECTION[:2]
    return entries


def register() -> None:
    """``on_ui_settings`` callback: add the options to ``shared.opts``."""
    from modules import shared

    for key, info in options(shared).items():
        shared.opts.add_option(key, info)
