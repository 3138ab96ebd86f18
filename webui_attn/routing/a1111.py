"""A1111 adapter: optimizer entries for Settings > Optimizations, and the class-level forward patches.

``SdOptimization`` is imported only when the entries are built (``on_list_optimizers`` fires), so importing
this module on Forge, where that class does not exist, raises nothing.

Entries and their titles (what ``config.json`` stores; never change them):
see ``ENTRIES``. Priorities, against the built-ins (xformers 100, Doggettx 90, sdp-no-mem 80, sdp 70,
sub-quadratic / InvokeAI up to 1000 on MPS / CPU):

* an entry whose own flag is given ranks above everything (FLAG_PRIORITY + n), so "Automatic" picks it;
* with no flag, the auto entry ranks AUTO_PRIORITY (above xformers and Doggettx) only when a fused GPU
  kernel is available that beats what A1111 would pick; otherwise every entry ranks 0 and A1111's own
  choice stays. On an AMD GPU (ROCm) that means a fused kernel the engine has for its gfx architecture
  (MI200/MI300, RDNA3/4 with AOTriton): on one without (gfx906, gfx1030) Doggettx stays.
* on a Mac (MPS) A1111's "Automatic" picks sub-quadratic (priority 1000 there) and the auto entry does
  not rank above it: the engine has no fused kernel on MPS (PyTorch's MPS SDPA materialises the score
  matrix; the engine's bounded path is a query-chunked loop like sub-quadratic's), and no measurement
  or published figure shows it at least as fast as sub-quadratic with bounded memory. The flags and
  the entries, chosen by name, still put it first.
* on a CPU A1111's "Automatic" picks InvokeAI (priority 1000 there); the auto entry ranks CPU_PRIORITY,
  above it, because it was measured faster there (see ``engine_wins_on_cpu``).
"""
from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import torch

import lib_attn
from lib_attn.device import default_device

from host_attn import status as host_status
from host_attn import voice
from host_attn.convention import make_heads_function
from host_attn.patching import Patches

from ..settings import flags, layers
from . import forwards


@dataclass(frozen=True)
class Entry:
    key: str
    name: str
    label: str
    cmd_opt: str | None      # flag dest; the auto entry's flag is whichever chain flag was given
    backend: str | None      # engine id put first for UNet/DiT; None = the configured / default chain
    rank: int                # order among our own flags when several are given

    @property
    def title(self) -> str:
        return f"{self.name} - {self.label}"


ENTRIES = (
    Entry("flash", "flash-attn", "FlashAttention 2/3, falls back per call", "opt_flash_attention", "flash-attn", 4),
    Entry("cudnn", "sdp-cudnn", "PyTorch cuDNN attention, falls back per call", "opt_cudnn_attention", "sdpa-cudnn", 3),
    Entry("efficient", "sdp-efficient", "PyTorch memory-efficient attention, falls back per call",
          "opt_efficient_attention", "sdpa-efficient", 2),
    Entry("sage", "sage", "SageAttention, falls back per call", "opt_sage_attention", "sage", 1),
    Entry("auto", "attn-auto", "fastest available per call", None, None, 5),
)
ENTRY_BY_KEY = {e.key: e for e in ENTRIES}

FLAG_PRIORITY = 10000   # beats every built-in, sub-quadratic/InvokeAI's 1000 included
AUTO_PRIORITY = 150     # beats xformers (100) and Doggettx (90) when the auto entry should win
CPU_PRIORITY = 1100     # beats InvokeAI's 1000 on a CPU
#: Engine backends that are fused GPU kernels, all faster than Doggettx's sliced einsum.
FUSED_GPU = frozenset({"flash-attn", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "xformers", "sage"})
#: Those that also beat xformers' own (cutlass) kernel, which A1111 picks when it is available.
BEATS_XFORMERS = frozenset({"flash-attn", "sdpa-cudnn"})

patches = Patches("a1111")


# --- probes ------------------------------------------------------------------------------------------

def _cmd_opts():
    from modules import shared
    return shared.cmd_opts


def available_backends() -> dict:
    """Engine backend id -> BackendInfo, from the engine's own probe."""
    return {info.id: info for info in lib_attn.backends()}


def fused_gpu_kernels() -> set:
    """Fused GPU kernels usable for the webui's device (empty unless it runs the model on CUDA or ROCm)."""
    from modules import shared
    device = getattr(shared, "device", None)
    if getattr(device, "type", None) != "cuda":
        return set()  # CPU, and MPS: see the module docstring
    found = {i for i, info in available_backends().items() if info.available} & FUSED_GPU
    if found and getattr(torch.version, "hip", None):
        found &= _rocm_fused(lib_attn.device_info(device))
    return found


def _rocm_fused(info) -> set:
    """The fused kernels the engine would run for SD1.5's 64x64 self-attention on this AMD GPU."""
    from lib_attn.kernels import REGISTRY
    from lib_attn.spec import CallSpec

    spec = CallSpec(info, torch.float16, 2, 8, 4096, 4096, 40)
    return {bid for bid in lib_attn.default_chain("unet", info, spec=spec)
            if bid in FUSED_GPU and not REGISTRY[bid].reasons(spec)}


def a1111_picks_xformers() -> bool:
    """Whether A1111's "Automatic" would otherwise land on xformers (it is available and ranks 100)."""
    from modules import shared
    return bool(getattr(shared, "xformers_available", False)
                or getattr(_cmd_opts(), "force_enable_xformers", False))


def engine_wins_on_cpu() -> bool:
    """Whether the webui runs the model on the CPU with PyTorch's SDPA (its CPU flash kernel) in the engine.

    Measured in the real A1111 1.10.1 on a 2-core CPU (torch 2.13, fp32, SD1.5's attention shapes at 512²,
    batch 2, the real ldm modules under each optimizer's forward, five interleaved rounds): per UNet step
    the engine's choice (``sdpa``) was 3.4x faster than InvokeAI and 3.1x faster than sub-quadratic, and
    faster on every call kind (1.4x-4.8x); the VAE's attention 1.5x faster than InvokeAI's.
    """
    from modules import shared
    if getattr(getattr(shared, "device", None), "type", None) != "cpu":
        return False
    info = available_backends().get("sdpa")
    return info is not None and info.available


def auto_beats_a1111() -> bool:
    fused = fused_gpu_kernels()
    if a1111_picks_xformers():
        return bool(fused & BEATS_XFORMERS)
    return bool(fused)


def flag_given(entry: Entry) -> bool:
    opts = _cmd_opts()
    if entry.key == "auto":
        return flags.given_chain_flag(opts) is not None
    return bool(getattr(opts, entry.cmd_opt, False))


def priority(entry: Entry) -> int:
    """The entry's rank among A1111's optimizers: the one place that decides what "Automatic" picks."""
    if flag_given(entry):
        return FLAG_PRIORITY + entry.rank
    if entry.key == "auto" and auto_beats_a1111():
        return AUTO_PRIORITY
    if entry.key == "auto" and engine_wins_on_cpu():
        return CPU_PRIORITY
    return 0


def entry_available(entry: Entry) -> bool:
    """Whether the entry is offered; the reason it is not is logged once per process.

    An entry whose flag was given is always offered, so that "Automatic" routes attention through the
    engine as the flag asks; calls its backend cannot take fall back per call, with the reason counted
    (``flags.startup_notes`` says so at startup).
    """
    if entry.backend is None or flag_given(entry):
        return True
    info = available_backends().get(entry.backend)
    if info is not None and info.available:
        return True
    voice.log_once("unavailable", not_offered_line())
    return False


def not_offered_line() -> str:
    """The entries A1111 will not list, in one line grouped by cause (``python -m lib_attn doctor`` and the
    availability table keep each backend's whole reason)."""
    infos = available_backends()
    device_type = default_device()   # device_info() would initialise CUDA at startup
    groups: dict = {}
    for entry in ENTRIES:
        info = infos.get(entry.backend)
        if entry.backend is None or flag_given(entry) or (info is not None and info.available):
            continue
        words = ("the engine does not know this backend" if info is None
                 else dict(host_status.CAUSES).get(host_status.cause(info, device_type)) or host_status.cause(info, device_type))
        groups.setdefault(words, []).append(entry.name)
    hint = f" — {host_status.WEBUI_INSTALL_HINT}"
    text = "; ".join(f"{', '.join(names)} ({words}){hint if words == 'not installed' else ''}"
                     for words, names in groups.items())
    return f"Not listed in {SETTING_PATH}: {text}"


# --- patching ----------------------------------------------------------------------------------------

def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def install() -> None:
    """Patch the forwards; a second call while patched does nothing.

    A1111's ``undo_optimizations()`` resets the four forwards without calling our ``undo()`` (training, a
    failed apply, ``undo_hijack``); patches found reset that way are dropped and made again.
    """
    if patches.active:
        if patches.intact():
            return
        patches.undo()
    _patch_forwards(patches)


def _patch_forwards(patches: Patches, lent: bool = False) -> list:
    """Put the engine's forwards on every attention class A1111 has loaded, recorded in ``patches``.

    ``lent``: copies of the forwards (the same code, other function objects), so that whether the lent ones
    are still in place never mistakes an entry's, applied over them since, for them."""
    cross, attnblock = forwards.cross_attention_forward, forwards.attnblock_forward
    if lent:
        cross, attnblock = _copy_function(cross), _copy_function(attnblock)
    done = []

    def patch(owner, attr, replacement, **kwargs):
        patches.patch(owner, attr, replacement, **kwargs)
        done.append((owner, attr))

    for name in ("ldm.modules.attention", "sgm.modules.attention"):
        module = _module(name)
        if module is not None and hasattr(module, "CrossAttention"):
            patch(module.CrossAttention, "forward", cross)
    ldm_model = _module("ldm.modules.diffusionmodules.model")
    if ldm_model is not None:
        for cls_name in ("AttnBlock", "MemoryEfficientAttnBlock"):
            cls = getattr(ldm_model, cls_name, None)
            if cls is not None:
                patch(cls, "forward", attnblock)
    sgm_model = _module("sgm.modules.diffusionmodules.model")
    if sgm_model is not None and hasattr(sgm_model, "AttnBlock"):
        patch(sgm_model.AttnBlock, "forward", attnblock, **_sgm_attnblock_restore(sgm_model))
    # SD3 binds ``attention`` by name at import; patch only once an SD3 model has imported it
    mmdit = sys.modules.get("modules.models.sd3.mmdit")
    if mmdit is not None and hasattr(mmdit, "attention"):
        patch(mmdit, "attention", make_heads_function("dit", fp32_rule=flags.fp32_for_upcast))
    return done


def _copy_function(fn):
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__module__ = fn.__module__
    return copy


def _sgm_attnblock_restore(sgm_model) -> dict:
    """A1111's ``undo_optimizations()`` leaves ldm's forward on sgm's AttnBlock (``sd_hijack.py`` 110); undo puts
    sgm's own back, and takes ldm's found there for A1111's reset (each re-apply runs it before the current
    optimizer's ``undo()``), not for another extension's wrapper."""
    sho = sys.modules.get("modules.sd_hijack_optimizations")
    ldm_original = getattr(sho, "diffusionmodules_model_AttnBlock_forward", None)
    sgm_original = getattr(sho, "sgm_diffusionmodules_model_AttnBlock_forward", None)
    if ldm_original is None or sgm_original is None:
        return {}
    current = sgm_model.AttnBlock.__dict__.get("forward")
    if current is ldm_original:
        return {"restore_to": sgm_original, "reset_to": ldm_original}
    return {"reset_to": ldm_original}


def uninstall() -> int:
    """Restore every patched object and clear the optimizer layer; safe to call again."""
    count = patches.undo()
    layers.set_layer("optimizer", None)
    return count


def optimizer_layer(entry: Entry) -> dict | None:
    """The ``optimizer`` layer for an entry: its backend first for UNet/DiT, other roles as the flags say."""
    if entry.backend is None:
        return None  # the auto entry defers to flags and settings, whose default is "fastest per call"
    base = (layers.get_layer("flags") or {}).get("preference")
    preference = dict(base) if isinstance(base, dict) else {}
    for role in flags.DENOISER_ROLES:
        preference[role] = [entry.backend]
    return {"preference": preference}


def apply_entry(entry: Entry) -> None:
    layers.set_layer("optimizer", optimizer_layer(entry))
    install()


# --- SdOptimization subclasses, built on first use --------------------------------------------------

_classes: dict = {}


def optimizer_classes() -> dict:
    """Entry key -> SdOptimization subclass (built once per SdOptimization class object)."""
    from modules.sd_hijack_optimizations import SdOptimization

    built = _classes.get(SdOptimization)
    if built is None:
        built = {entry.key: _make_class(SdOptimization, entry) for entry in ENTRIES}
        _classes.clear()
        _classes[SdOptimization] = built
    return built


def _make_class(base, entry: Entry):
    class Optimization(base):
        name = entry.name
        label = entry.label
        webui_attn_entry = entry

        @property
        def cmd_opt(self):
            if entry.key == "auto":
                return flags.given_chain_flag(_cmd_opts())
            return entry.cmd_opt

        @property
        def priority(self):
            return priority(entry)

        def title(self):
            return entry.title

        def is_available(self):
            return entry_available(entry)

        def apply(self):
            apply_entry(entry)

        def undo(self):
            # not super().undo(): the record knows the true originals, A1111's base resets to its own
            uninstall()

    Optimization.__name__ = Optimization.__qualname__ = f"SdOptimizationLibAttn_{entry.key}"
    return Optimization


def list_optimizers(res: list) -> None:
    """``on_list_optimizers`` callback: append one instance per entry (A1111 filters by availability)."""
    for entry in ENTRIES:
        res.append(optimizer_classes()[entry.key]())


def is_ours(optimizer) -> bool:
    return getattr(optimizer, "webui_attn_entry", None) is not None


SETTING_PATH = "Settings → Optimizations → Cross attention optimization"


def route_hint() -> str:
    flags_text = ", ".join(f"--{dest.replace('_', '-')}" for dest, _ in flags.OPT_FLAGS)
    return (f"to route attention through this extension, choose '{ENTRY_BY_KEY['auto'].title}' (or another "
            f"of its entries) in {SETTING_PATH}, or start the webui with one of {flags_text} or --attn-backend")


# --- A1111's own attention flags ------------------------------------------------------------------------

#: A1111's attention flags (dest, spelling, the optimizer "Automatic" then applies). ``apply_optimizations``
#: takes, under "Automatic", the first optimizer (by priority) whose flag is given, before it looks at
#: priorities at all; ``--disable-opt-split-attention`` makes "Automatic" apply none.
A1111_FLAGS = (
    ("xformers", "--xformers", "xformers (listed only when xformers imports and the GPU's compute capability "
                               "is 6.0 to 9.0; otherwise the flag picks nothing)"),
    ("force_enable_xformers", "--force-enable-xformers", "xformers only with --xformers (it lists xformers "
                                                         "whatever the GPU)"),
    ("opt_sdp_no_mem_attention", "--opt-sdp-no-mem-attention", "sdp-no-mem"),
    ("opt_sdp_attention", "--opt-sdp-attention", "sdp"),
    ("opt_split_attention", "--opt-split-attention", "Doggettx"),
    ("opt_sub_quad_attention", "--opt-sub-quad-attention", "sub-quadratic"),
    ("opt_split_attention_v1", "--opt-split-attention-v1", "V1"),
    ("opt_split_attention_invokeai", "--opt-split-attention-invokeai", "InvokeAI"),
)


def a1111_flags_given(cmd_opts) -> list[tuple[str, str]]:
    """(spelling, the optimizer it makes "Automatic" apply) of each A1111 attention flag given."""
    return [(spelling, picks) for dest, spelling, picks in A1111_FLAGS if getattr(cmd_opts, dest, False)]


def a1111_flags_note(cmd_opts) -> str | None:
    """One startup line on what the A1111 attention flags given do to this extension's part; None without
    any."""
    given = a1111_flags_given(cmd_opts)
    disabled = getattr(cmd_opts, "disable_opt_split_attention", False)
    if not given and not disabled:
        return None
    names = " ".join(spelling for spelling, _ in given) or "--disable-opt-split-attention"
    if any(flag_given(entry) for entry in ENTRIES):
        return (f"{names} (A1111): this extension's own flag is given too and ranks first, so with Cross attention "
                f"optimization \"Automatic\" attention goes through this extension")
    if disabled:
        return ("--disable-opt-split-attention (A1111): with Cross attention optimization \"Automatic\" A1111 applies "
                "no optimization and attention does not go through this extension; choose one of its entries in "
                f"{SETTING_PATH} to route it here")
    picks = "; ".join(f"{spelling} picks {what}" for spelling, what in given)
    return (f"{names} (A1111): with Cross attention optimization \"Automatic\" A1111 applies the optimizer of the "
            f"first such flag before it looks at priorities ({picks}), so attention goes through this extension "
            f"only in generations that ask for it: a backend, VAE backend, schedule or sparse attention set in this "
            f"extension's settings or flags, or a backend, schedule or sparse attention chosen for the generation. "
            f"To route every generation, "
            f"{route_hint().removeprefix('to route attention through this extension, ')}")


# --- a generation that asks for the engine while "Automatic" applied one of A1111's optimizers ----------
#
# The extension's forwards are lent over A1111's optimizer from the generation's ``process`` to its end. A1111
# re-applies its optimizer inside a generation whenever it loads weights (``reload_model_weights``: the
# refiner's switch, a hires checkpoint, the switch back at the next batch; ``sd_hijack.apply_optimizations``
# from ``hijack``), which first resets the forwards. ``apply_optimizations`` is watched for that: after it,
# what was lent is forgotten (A1111's own forwards are there now) and, while a generation that asked is open
# and "Automatic" still put one of A1111's own optimizers there, lent again over the new ones. A generation's
# end takes back only its own lend; the forwards go back to A1111's when no open generation holds one.

#: One token per open generation that holds a lend (nested generations share the forwards).
_lends: list = []
#: The forwards lent over A1111's; replaced by a fresh record when A1111 re-applies its optimizer.
_lent_forwards = Patches("a1111-lend")
#: (owner, attribute, the lent function, what it replaced) of each lent forward.
_lent_targets: list = []
#: The watch on ``modules.sd_hijack.apply_optimizations`` (from ``register`` to the script's unload).
_watch = Patches("a1111-watch")


def may_lend(opts) -> bool:
    """Whether a generation that asks for this extension's backends may put its forwards over A1111's
    optimizer: Cross attention optimization is "Automatic" (not an A1111 entry chosen by name, nor "None",
    nor ``--disable-opt-split-attention``) and A1111 applied one of its own optimizers."""
    current = getattr(sys.modules.get("modules.sd_hijack"), "current_optimizer", None)
    selection = getattr(opts, "cross_attention_optimization", "Automatic") if opts is not None else "Automatic"
    return (selection == "Automatic" and current is not None and not is_ours(current)
            and not getattr(_cmd_opts(), "disable_opt_split_attention", False) and not patches.active)


def _own_value(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def _lend_forwards() -> None:
    """Lend the forwards over what is there now, unless the lent ones are still in place."""
    global _lent_forwards, _lent_targets
    if _lent_forwards.active and _lent_forwards.intact():
        return
    _take_back_lend()
    _lent_targets = [(owner, attr, _own_value(owner, attr), _lent_forwards.original(owner, attr))
                     for owner, attr in _patch_forwards(_lent_forwards, lent=True)]


def _take_back_lend() -> None:
    """Put back what the lent forwards replaced, where they are still in place: A1111 resets the forwards
    it knows when it re-applies an optimizer, and what it (or an entry chosen since) put there stays."""
    global _lent_forwards, _lent_targets
    for owner, attr, lent, replaced in _lent_targets:
        if _own_value(owner, attr) is lent:
            setattr(owner, attr, replaced)
    _lent_forwards, _lent_targets = Patches("a1111-lend"), []


def lend_for_generation(opts):
    """Put this extension's forwards over A1111's optimizer for one generation (``may_lend``); returns the
    generation's token (None when not lent), which ``end_generation`` takes back."""
    if not may_lend(opts):
        return None
    token = object()
    _lends.append(token)
    _lend_forwards()
    return token


def end_generation(token) -> None:
    """The generation of ``token`` is over: its lend is taken back, and A1111's forwards put back when no
    other open generation holds one."""
    if token in _lends:
        _lends.remove(token)
    if not _lends:
        _take_back_lend()


def _shared_opts():
    return getattr(sys.modules.get("modules.shared"), "opts", None)


def _after_apply_optimizations() -> None:
    """A1111 has just reset the forwards and applied an optimizer: lend again over it while a generation
    holds a lend and the user's choice still lets one (an entry chosen since stays in force)."""
    if _lent_forwards.active and _lent_forwards.intact():
        return   # lent already over what this call applied (a second watch further in)
    if _lends and may_lend(_shared_opts()):
        _lend_forwards()
    else:
        _take_back_lend()


def _watched(apply_optimizations):
    def watched_apply_optimizations(option=None):
        try:
            return apply_optimizations(option)
        finally:
            _after_apply_optimizations()

    watched_apply_optimizations.__wrapped__ = apply_optimizations
    return watched_apply_optimizations


def watch() -> None:
    """Watch A1111's ``apply_optimizations`` (its module function, which ``model_hijack`` calls by name)."""
    global _watch
    sd_hijack = sys.modules.get("modules.sd_hijack") or _module("modules.sd_hijack")
    if sd_hijack is None or not hasattr(sd_hijack, "apply_optimizations"):
        return
    if _watch.active and _watch.intact():
        return
    # wrapped over since by someone else: their wrapper stays, and ours inside it keeps working
    _watch = Patches("a1111-watch")
    _watch.patch(sd_hijack, "apply_optimizations", _watched(sd_hijack.apply_optimizations))


def unload() -> None:
    """The entry script is unloaded (Reload UI): every lend taken back, the watch and the forwards undone."""
    _lends.clear()
    _take_back_lend()
    if _watch.intact():
        _watch.undo()
    uninstall()


def lent_note() -> str | None:
    """What the readout says of a generation routed here over A1111's "Automatic" choice."""
    current = getattr(sys.modules.get("modules.sd_hijack"), "current_optimizer", None)
    if not _lends or current is None:
        return None
    flags_text = " ".join(spelling for spelling, _ in a1111_flags_given(_cmd_opts()))
    why = f" (from {flags_text})" if flags_text else ""
    return (f"this generation went through this extension, as its settings or the generation's choice ask, over "
            f"A1111's {current.name} optimizer that \"Automatic\" applied{why}; A1111's is put back when it ends")


def routing() -> voice.Routing:
    """Whether attention runs through the engine: A1111's applied optimizer is one of ours and the
    forwards it patched are still in place, or a generation asked for the engine over A1111's "Automatic"
    choice (``lend_for_generation``) and they are in place. Otherwise what runs instead, and how to route it here."""
    current = getattr(sys.modules.get("modules.sd_hijack"), "current_optimizer", None)
    if _lends and _lent_forwards.active and _lent_forwards.intact():
        return voice.ROUTED
    if is_ours(current):
        if patches.active and patches.intact():
            return voice.ROUTED
        return voice.Routing(False, "A1111's default attention forwards (the webui reset the forwards "
                                   f"'{current.title()}' patched)",
                            f"choose '{current.title()}' again in {SETTING_PATH} or reload the model")
    if current is None:
        ran_on = ("A1111's attention without an optimization (Cross attention optimization \"None\", "
                  "--disable-opt-split-attention, or no model loaded yet)")
    else:
        ran_on = f"A1111's {current.name} optimizer"
    return voice.Routing(False, ran_on, route_hint())


def register(script_callbacks) -> None:
    """Called at entry-script import: flags layer, the optimizer list callback, undo on unload.

    After "Reload UI" A1111 keeps its old ``current_optimizer`` without re-applying it; when that is one of
    ours the patches (undone at unload) are put back here so the running model keeps this extension.
    """
    flags.apply(_cmd_opts())
    flags.say_startup(_cmd_opts())
    note = a1111_flags_note(_cmd_opts())
    if note:
        voice.log_once(("a1111-flags", note), note)
    script_callbacks.on_list_optimizers(list_optimizers)
    script_callbacks.on_script_unloaded(unload)
    watch()
    current = getattr(sys.modules.get("modules.sd_hijack"), "current_optimizer", None)
    if is_ours(current):
        apply_entry(current.webui_attn_entry)
