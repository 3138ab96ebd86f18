"""Command-line flags (added by ``preload.py``) turned into the engine's ``flags`` configuration layer.

Both hosts read the flags from ``shared.cmd_opts``; Forge's own ``backend.args.args`` never sees them.
A flag with an unknown backend id is reported with the valid ids and ignored, so the webui starts as if
it had not been given.
"""
from __future__ import annotations

import lib_attn
from lib_attn.config import FP32_POLICIES, TUNE_MODES

from . import host, layers

#: ``--opt-*-attention`` flag dest -> the engine backend it puts first, in the order they combine.
OPT_FLAGS = (
    ("opt_flash_attention", "flash-attn"),
    ("opt_cudnn_attention", "sdpa-cudnn"),
    ("opt_efficient_attention", "sdpa-efficient"),
    ("opt_sage_attention", "sage"),
)
#: Chain flags: dest -> command-line spelling.
CHAIN_FLAGS = {"attn_backend": "--attn-backend", "attn_vae_backend": "--attn-vae-backend"}
#: Roles a UNet/DiT choice applies to; the VAE has its own flag because its head dim (512) suits few kernels.
DENOISER_ROLES = ("unet", "dit")


def parse_ids(text) -> tuple[list[str], list[str]]:
    """Split ``"a,b, c"`` into (known ids, unknown ids), keeping order and dropping repeats."""
    known, unknown = [], []
    for part in str(text or "").split(","):
        item = part.strip()
        if not item or item in known or item in unknown:
            continue
        (known if item in lib_attn.BACKEND_IDS else unknown).append(item)
    return known, unknown


def valid_chain(cmd_opts, dest: str) -> list[str] | None:
    """The ids a chain flag names, or None when it is absent or names any unknown id."""
    value = getattr(cmd_opts, dest, None)
    if not value:
        return None
    known, unknown = parse_ids(value)
    return None if unknown or not known else known


def given_chain_flag(cmd_opts) -> str | None:
    """The dest of the first valid chain flag given (``attn_backend`` or ``attn_vae_backend``), else None."""
    for dest in CHAIN_FLAGS:
        if valid_chain(cmd_opts, dest):
            return dest
    return None


def opt_flag_ids(cmd_opts) -> list[str]:
    """Backend ids of the ``--opt-*-attention`` flags given, in OPT_FLAGS order."""
    return [backend for dest, backend in OPT_FLAGS if getattr(cmd_opts, dest, False)]


def problems(cmd_opts) -> list[str]:
    """One message per malformed flag, naming the valid ids."""
    out = []
    for dest, spelling in CHAIN_FLAGS.items():
        value = getattr(cmd_opts, dest, None)
        if value is None:
            continue
        known, unknown = parse_ids(value)
        if unknown or not known:
            what = f"unknown backend id(s) {', '.join(map(repr, unknown))}" if unknown else "no backend id"
            out.append(f"{spelling} {value!r}: {what}; valid ids: {', '.join(lib_attn.BACKEND_IDS)}. "
                       f"The flag is ignored.")
    fp32 = getattr(cmd_opts, "attn_fp32", None)
    if fp32 is not None and fp32 not in FP32_POLICIES:
        out.append(f"--attn-fp32 {fp32!r}: must be cast or keep. The flag is ignored.")
    tune = getattr(cmd_opts, "attn_tune", None)
    if tune is not None and tune not in TUNE_MODES:
        out.append(f"--attn-tune {tune!r}: must be on or off. The flag is ignored.")
    return out


def layer_from(cmd_opts) -> dict | None:
    """The ``flags`` layer the command line asks for; None when no attention flag was given.

    ``--attn-backend`` names the UNet/DiT chain outright; otherwise the ``--opt-*-attention`` flags given
    form it. ``--attn-vae-backend`` names the VAE chain. Roles not named keep the engine's default chain.
    """
    preference: dict[str, list[str]] = {}
    chain = valid_chain(cmd_opts, "attn_backend") or opt_flag_ids(cmd_opts)
    if chain:
        for role in DENOISER_ROLES:
            preference[role] = list(chain)
    vae = valid_chain(cmd_opts, "attn_vae_backend")
    if vae:
        preference["vae"] = vae
    layer = {}
    if preference:
        layer["preference"] = preference
    fp32 = getattr(cmd_opts, "attn_fp32", None)
    if fp32 in FP32_POLICIES:
        layer["fp32"] = fp32
    if getattr(cmd_opts, "attn_strict", False):
        layer["strict"] = True
    tune = getattr(cmd_opts, "attn_tune", None)
    if tune in TUNE_MODES:
        layer["tune"] = tune
    return layer or None


def apply(cmd_opts) -> dict | None:
    """Report malformed flags once, then set the ``flags`` layer; returns the layer set."""
    for message in problems(cmd_opts):
        host.log_once(("flag", message), message)
    layer = layer_from(cmd_opts)
    layers.set_layer("flags", layer)
    return layer


def startup_note(cmd_opts) -> str | None:
    """One line on the UNet/DiT chain the flags give: it goes through the engine even when a backend in
    it cannot run here, whose calls then fall back per call with the reason counted. None without flags."""
    chain = valid_chain(cmd_opts, "attn_backend")
    if chain:
        given = f"--attn-backend {','.join(chain)}"
    else:
        chain = opt_flag_ids(cmd_opts)
        given = " ".join(f"--{dest.replace('_', '-')}" for dest, backend in OPT_FLAGS if backend in chain)
    if not chain:
        return None
    text = f"{given}: UNet/DiT attention goes through this extension, {chain[0]} first"
    infos = {b.id: b for b in lib_attn.backends()}
    missing = [f"{i} ({infos[i].reason})" for i in chain if i in infos and not infos[i].available]
    if missing:
        text += (f"; cannot run here: {'; '.join(missing)}, so its calls fall back per call, counted with the "
                 f"reason in the readout")
    return text


def say_startup(cmd_opts) -> None:
    note = startup_note(cmd_opts)
    if note:
        host.log_once(("startup", note), note)


def fp32_for_upcast(upcast: bool) -> str | None:
    """The per-call fp32 policy when the host asked for fp32 attention: ``keep`` unless a layer chose one.

    The user's explicit ``--attn-fp32`` (or a setting) wins over the host's upcast request.
    """
    if not upcast:
        return None
    for name in layers.ORDER:
        layer = layers.get_layer(name) or {}
        if layer.get("fp32") is not None:
            return None
    return "keep"
