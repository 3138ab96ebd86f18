"""The extension's settings in Settings > Optimizations, and the ``settings`` configuration layer.

Every key starts with ``flash_attn_``. Values are read again at every generation (and pushed at once
by each option's onchange), so a change applies to the next generation without a restart. "Auto"
leaves the choice to the weaker layers: command-line flags, the A1111 optimizer, the engine default.
"""
from __future__ import annotations

import lib_attn
from lib_attn.config import FP32_POLICIES, TUNE_MODES

from . import host, layers
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
    """The backends that cannot run here, each with its reason (plain text, for a dropdown's info line)."""
    missing = [f"{b.id} ({b.reason})" for b in lib_attn.backends() if not b.available]
    return "Not available here: " + "; ".join(missing) if missing else "Every backend is available here."


INFO = {
    KEY_BACKEND: lambda: ("Auto: the command-line flag or chosen optimizer if any, else the fastest that can take "
                          "each call. " + unavailable_text()),
    KEY_VAE_BACKEND: lambda: "The VAE attends over one head of 512 channels, which flash-attn and SageAttention "
                             "cannot take.",
    KEY_FP32: lambda: "cast: run half-only kernels in bf16/fp16 and cast the output back; keep: only kernels that "
                      "take fp32",
}


def _component_args(key: str):
    """Arguments of a setting's component, built when the settings page is.

    The info line is gradio's own ``info`` argument, which gradio 3 and 4 both draw: the hosts' script
    that draws ``OptionInfo.info()`` text finds no label element in a gradio 4 dropdown, so on Forge
    that text never shows.
    """
    def args():
        from . import ui

        out = {"info": INFO[key]()}
        if key == KEY_FP32:
            out["choices"] = list(FP32_CHOICES)
        else:
            out["choices"] = ui.choices(AUTO, pairs=ui.gradio_major() >= 4)
        return out

    return args


def read(opts) -> dict:
    """The extension's values from ``opts`` (defaults for keys the host has not registered yet)."""
    out = {}
    for key, default in DEFAULTS.items():
        value = getattr(opts, key, None) if opts is not None else None
        out[key] = default if value is None else value
    return out


def _backend_id(value) -> str | None:
    """A setting's backend id (a dropdown label names its id too), or None for Auto and for a value that
    is no backend id (stale config, a bad API value: ``problems`` names those)."""
    from .ui import backend_from_choice

    return backend_from_choice(value)


def problems(values: dict) -> list[str]:
    """One message per stored value that is ignored, naming the setting, the value and the valid ones."""
    out = []
    for key in (KEY_BACKEND, KEY_VAE_BACKEND):
        value = values.get(key)
        if value not in (None, AUTO) and _backend_id(value) is None:
            out.append(f"setting {key}={value!r} ignored (not a backend id), {AUTO} used; valid: "
                       f"{', '.join(backend_choices())}")
    fp32 = values.get(KEY_FP32)
    if fp32 is not None and fp32 not in FP32_CHOICES:
        out.append(f"setting {KEY_FP32}={fp32!r} ignored, {AUTO} used; valid: {', '.join(FP32_CHOICES)}")
    return out


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
    values = read(opts)
    for message in problems(values):
        host.log_once(("setting", message), message)
    return layers.set_layer("settings", layer_from(values))


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
    entries = {
        KEY_BACKEND: OptionInfo(AUTO, "Attention backend for the UNet / DiT (flash-attention extension)",
                                gr.Dropdown, _component_args(KEY_BACKEND), onchange=_on_change),
        KEY_VAE_BACKEND: OptionInfo(AUTO, "Attention backend for the VAE", gr.Dropdown,
                                    _component_args(KEY_VAE_BACKEND), onchange=_on_change),
        KEY_FP32: OptionInfo(AUTO, "fp32 attention inputs", gr.Radio, _component_args(KEY_FP32),
                             onchange=_on_change),
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
