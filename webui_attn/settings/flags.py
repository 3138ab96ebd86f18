"""Command-line flags turned into the engine's configuration layers.

* This extension's flags (added by ``preload.py``) make the ``flags`` layer. Every host reads them from
  ``shared.cmd_opts``. A flag with an unknown backend id is reported with the valid ids and ignored, so
  the webui starts as if it had not been given.
* The host's own attention flags make the weaker ``host`` layer, with the host's meaning (``HOST_FLAGS``):
  a flag that makes the host use a kernel puts that kernel first for the UNet/DiT, in the host's own
  order; a flag that keeps the host off a kernel keeps it out of the default chains. The kernels Forge
  Neo and Forge Classic choose because their packages import (``HOST_KERNELS``) are put first the same
  way. They are read
  where the host parsed them (``shared.cmd_opts``, and ``backend.args.args`` or ldm_patched's
  ``args_parser.args``) and never redefined.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import lib_attn
from lib_attn import schedule as schedules
from lib_attn import sparse as sparse_settings
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES, parse_ids

from host_attn import voice

from . import layers

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
    guard = getattr(cmd_opts, "attn_guard", None)
    if guard is not None and guard not in GUARD_MODES:
        out.append(f"--attn-guard {guard!r}: must be one of {', '.join(GUARD_MODES)}. The flag is ignored.")
    problem = schedule_problem(getattr(cmd_opts, "attn_schedule", None))
    if problem:
        out.append(f"--attn-schedule: {problem}. The flag is ignored.")
    problem = sparse_problem(getattr(cmd_opts, "attn_sparse", None))
    if problem:
        out.append(f"--attn-sparse: {problem}. The flag is ignored.")
    return out


def schedule_problem(text) -> str | None:
    """Why a schedule text cannot be used (the rule, the part and what is valid), or None when it can."""
    try:
        schedules.parse(text)
    except schedules.ScheduleError as exc:
        return str(exc)
    return None


def sparse_problem(text) -> str | None:
    """Why sparse settings cannot be used (the value that is wrong and the valid ones), or None when they can."""
    try:
        sparse_settings.parse(text)
    except sparse_settings.SparseError as exc:
        return str(exc)
    return None


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
    guard = getattr(cmd_opts, "attn_guard", None)
    if guard in GUARD_MODES:
        layer["guard"] = guard
    text = getattr(cmd_opts, "attn_schedule", None)
    if text is not None and schedule_problem(text) is None:
        layer["schedule"] = text
    text = getattr(cmd_opts, "attn_sparse", None)
    if text is not None and sparse_problem(text) is None:
        layer["sparse"] = text
    return layer or None


def apply(cmd_opts) -> dict | None:
    """Report malformed flags once, then set the ``flags`` layer; returns the layer set."""
    for message in problems(cmd_opts):
        voice.log_once(("flag", message), message)
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
        voice.log_once(("startup", note), note)


# --- the host's own attention flags --------------------------------------------------------------------

@dataclass(frozen=True)
class HostFlag:
    """One of a host's own attention flags: ``prefer`` is the engine backend it makes the host use,
    ``avoid`` the one it keeps the host off; ``note`` says what the engine makes of a flag it has
    no kernel for. A flag with a ``value`` is given when its dest holds that value (Neo's enums);
    its kernel then takes the place of ``instead_of`` where the host runs that one (``host_choices``)."""

    spelling: str
    dest: str
    prefer: str | None = None
    avoid: str | None = None
    note: str | None = None
    value: str | None = None
    instead_of: str | None = None

    def given_in(self, namespace) -> bool:
        found = getattr(namespace, self.dest, None)
        if self.value is None:
            return found is True
        return found is not None and str(getattr(found, "value", found)) == self.value


#: Forge Neo's choice of SageAttention 2 kernel (``--sage2-function``, later ``--sage-function``, an
#: enum whose values name the package's functions) -> the engine backend that pins the same kernel.
NEO_SAGE_FUNCTIONS = {"fp16_triton": "sage-triton", "fp16_cuda": "sage-cuda", "fp8_cuda": "sage-fp8",
                      "fp8_cuda++": "sage-fp8pp", "sageattn3": "sage3"}


def _neo_sage_functions() -> tuple:
    return tuple(HostFlag(f"{spelling} {value}", dest, prefer=backend, value=value, instead_of="sage")
                 for spelling, dest in (("--sage2-function", "sage2_function"), ("--sage-function", "sage_function"))
                 for value, backend in NEO_SAGE_FUNCTIONS.items())


#: Host key (``hosts.Host.key``) -> its attention flags, in the order the host itself prefers kernels.
#: reForge uses the kernel its ``--use-*`` flag names (and exits at startup when its package is
#: missing); ``--attention-pytorch`` keeps Forge, Neo, reForge and Classic off xformers. Forge Neo and
#: Forge Classic use SageAttention, flash-attn and xformers whenever they import (their ``--sage`` /
#: ``--flash`` / ``--xformers`` only install them): that choice is read where they make it
#: (``HOST_KERNELS``), and Neo's ``--sage2-function`` with it.
HOST_FLAGS = {
    "forge": (
        HostFlag("--disable-xformers", "disable_xformers", avoid="xformers"),
        HostFlag("--attention-pytorch", "attention_pytorch", avoid="xformers"),
    ),
    "neo": _neo_sage_functions() + (
        HostFlag("--disable-sage", "disable_sage", avoid="sage"),
        HostFlag("--disable-flash", "disable_flash", avoid="flash-attn"),
        HostFlag("--disable-xformers", "disable_xformers", avoid="xformers"),
        HostFlag("--attention-pytorch", "attention_pytorch", avoid="xformers"),
    ),
    "reforge": (
        HostFlag("--use-sage-attention3", "use_sage_attention3", prefer="sage3"),
        HostFlag("--use-sage-attention", "use_sage_attention", prefer="sage"),
        HostFlag("--use-flash-attention", "use_flash_attention", prefer="flash-attn"),
        HostFlag("--disable-xformers", "disable_xformers", avoid="xformers"),
        HostFlag("--attention-pytorch", "attention_pytorch", avoid="xformers"),
    ),
    "classic": (
        HostFlag("--disable-sage", "disable_sage", avoid="sage"),
        HostFlag("--disable-xformers", "disable_xformers", avoid="xformers"),
        HostFlag("--attention-pytorch", "attention_pytorch", avoid="xformers"),
    ),
}
#: Where each host keeps the namespace its own parser filled, besides ``shared.cmd_opts``.
HOST_ARGS = {"forge": "backend.args", "neo": "backend.args", "reforge": "ldm_patched.modules.args_parser",
             "classic": "ldm_patched.modules.args_parser"}


def host_namespaces(host_key: str) -> list:
    """The parsed flags of the running host: ``shared.cmd_opts`` and its own parser's ``args``."""
    found = []
    shared = sys.modules.get("modules.shared")
    if getattr(shared, "cmd_opts", None) is not None:
        found.append(shared.cmd_opts)
    name = HOST_ARGS.get(host_key)
    if name:
        try:
            args = getattr(importlib.import_module(name), "args", None)
        except ImportError:
            args = None
        if args is not None:
            found.append(args)
    return found


def host_flags_given(host_key: str, namespaces) -> list[HostFlag]:
    """The host's own attention flags given on its command line, in the host's order."""
    return [f for f in HOST_FLAGS.get(host_key, ()) if any(f.given_in(ns) for ns in namespaces)]


#: Host key -> (the module where the host decides by import which kernels it can use, then per
#: kernel in the host's order: that module's constant, the engine backend, the package it imports).
HOST_KERNELS = {
    "neo": ("backend.memory_management", (("SAGE_IS_AVAILABLE", "sage", "sageattention"),
                                          ("FLASH_IS_AVAILABLE", "flash-attn", "flash_attn"),
                                          ("XFORMERS_IS_AVAILABLE", "xformers", "xformers"))),
    "classic": ("ldm_patched.modules.model_management", (("SAGE_IS_AVAILABLE", "sage", "sageattention"),
                                                         ("XFORMERS_IS_AVAILABLE", "xformers", "xformers"))),
}
#: What a host's choice of a kernel covers, where it is not every model (said with the choice).
HOST_KERNEL_SCOPE = {("classic", "sage"): "the host runs it on SDXL only, this extension on every model"}


@dataclass(frozen=True)
class HostChoice:
    """A kernel the host runs of its own accord: ``backend`` (the engine's id for it), ``why`` (how the
    host came to it, in its terms)."""

    backend: str
    why: str


def _package_version(package: str) -> str:
    """The installed version, as the hosts read it (``importlib.metadata``); "" when it has none."""
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or broken metadata: no version known
        return ""


def host_choices(host_key: str, given=()) -> list[HostChoice]:
    """The kernels the host runs because their packages import, in its order, read from the constants
    it set at import (which already hold its ``--disable-*`` and ``--attention-pytorch``). Neo runs the
    SageAttention 2 function ``--sage2-function`` (later ``--sage-function``) names only with SageAttention
    2 installed (2025-10: ``IS_SAGE_2``, the version starts with "2"; later: it does not start with "1");
    with 1.x it runs ``sageattn``, whatever the flag."""
    module_name, kernels = HOST_KERNELS.get(host_key, (None, ()))
    module = sys.modules.get(module_name) if module_name else None
    out = []
    for constant, backend, package in kernels:
        if not getattr(module, constant, False):
            continue
        version = _package_version(package)
        why = f"{package} {version} imports" if version else f"{package} imports"
        if backend == "sage":
            pinned = next((f for f in given if f.instead_of == "sage"), None)
            if pinned is not None and version and not version.startswith("1"):
                backend, why = pinned.prefer, f"{why}, {pinned.spelling}"
            elif pinned is not None:
                why += f"; {pinned.spelling} applies to SageAttention 2 only, so the host runs sageattn"
        scope = HOST_KERNEL_SCOPE.get((host_key, backend))
        out.append(HostChoice(backend, f"{why}; {scope}" if scope else why))
    return out


def host_layer(given, chosen=()) -> dict | None:
    """The ``host`` layer for the host flags given and the kernels the host chose (``HostChoice``): their
    kernels first for the UNet/DiT (a kernel the host was told to keep off is not preferred), the
    kept-off ones out of the default chains."""
    avoid = list(dict.fromkeys(f.avoid for f in given if f.avoid))
    # a flag that pins a kernel in another's place (Neo's --sage2-function) counts through the choice
    prefer = [b for b in dict.fromkeys([*(c.backend for c in chosen),
                                        *(f.prefer for f in given if f.prefer and f.instead_of is None)])
              if b not in avoid]
    layer = {}
    if prefer:
        layer["preference"] = {role: prefer for role in DENOISER_ROLES}
    if avoid:
        layer["avoid"] = avoid
    return layer or None


def host_notes(host_name: str, given) -> list[str]:
    """One line per host flag given: what the engine makes of it, and whether its kernel runs here."""
    infos = {b.id: b for b in lib_attn.backends()}
    out = []
    for f in given:
        if f.note:
            out.append(f"{host_name} {f.spelling}: {f.note}")
        elif f.prefer:
            text = f"{host_name} {f.spelling}: UNet/DiT attention prefers {f.prefer} in this extension"
            info = infos.get(f.prefer)
            if info is not None and not info.available:
                text += (f"; cannot run here: {info.reason}, so its calls fall back per call, counted with the "
                         f"reason in the readout")
            out.append(text)
        else:
            out.append(f"{host_name} {f.spelling}: {f.avoid} is left out of this extension's default chains")
    return out


def _cannot_run(backend: str) -> str:
    info = {b.id: b for b in lib_attn.backends()}.get(backend)
    if info is None or info.available:
        return ""
    return f"; cannot run here: {info.reason}, so its calls fall back per call, counted with the reason in the readout"


def choice_notes(host_name: str, chosen, cmd_opts=None) -> list[str]:
    """One line per kernel the host chose: why the host runs it, what this extension does with it, and
    what this extension's own flags put first instead."""
    out = []
    for choice in chosen:
        text = (f"{host_name} chooses {choice.backend} on an NVIDIA GPU ({choice.why}): UNet/DiT attention prefers "
                f"{choice.backend} in this extension{_cannot_run(choice.backend)}")
        chain = (valid_chain(cmd_opts, "attn_backend") or opt_flag_ids(cmd_opts)) if cmd_opts is not None else None
        if chain and chain[0] != choice.backend:
            text += f"; this extension's flags put {chain[0]} first instead"
        out.append(text)
    return out


#: The kernels the running host chose (``HostChoice``), set by ``apply_host``.
_chosen: tuple = ()


def host_choice_note(host_name: str) -> str | None:
    """A generation's note on the host's own kernel: first, as the host's choice, or set aside by what
    this generation's chain in force puts first. None when the host chose none (or its layer is gone)."""
    host = (layers.get_layer("host") or {}).get("preference") or {}
    if not _chosen or (host.get("unet") or [None])[0] != _chosen[0].backend:
        return None
    choice = _chosen[0]
    chain = lib_attn.config().preference.get("unet") or ()
    if chain and chain[0] == choice.backend:
        return f"{choice.backend} first as {host_name}'s own choice on an NVIDIA GPU ({choice.why})"
    first = chain[0] if chain else "the default order"
    return f"{host_name}'s own choice {choice.backend} on an NVIDIA GPU ({choice.why}) set aside: {first} first"


def apply_host(host) -> dict | None:
    """Set the ``host`` layer from the running host's own flags and the kernels it chose, and say what
    each one does; ``host`` is a ``hosts.Host``."""
    global _chosen
    namespaces = host_namespaces(host.key)
    given = host_flags_given(host.key, namespaces)
    chosen = host_choices(host.key, given)
    shared = sys.modules.get("modules.shared")
    notes = host_notes(host.name, [f for f in given if f.instead_of is None])
    notes += choice_notes(host.name, chosen, getattr(shared, "cmd_opts", None))
    for note in notes:
        voice.log_once(("host-flag", note), note)
    _chosen = tuple(chosen)
    layer = host_layer(given, chosen)
    layers.set_layer("host", layer)
    return layer


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
