"""The custom nodes: Attention backend (MODEL -> MODEL), VAE attention backend (VAE -> VAE) and
Attention report (shows what the run's attention did).

Choices list only valid values, which ComfyUI checks itself ("Value not in list", on the input that
holds the value); a backend chain and a schedule typed by hand are checked before the graph runs
(``VALIDATE_INPUTS``) and again when the node runs, with a message naming the bad part and the valid
ones. ComfyUI 0.8.0 calls ``VALIDATE_INPUTS`` with the inputs it names that the prompt holds (an
optional input a graph saved before it existed lacks is left out, so it keeps its default), and
reports a failed check once for every input it was given, each time with the same text: the text
names what is wrong (``unknown backend id …`` for the chain, ``schedule rule N (…)`` for the schedule).
"""
from __future__ import annotations

import lib_attn
from lib_attn import schedule as schedules
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES
from lib_attn.config import parse_ids

from host_attn import readout
from host_attn.status import unavailable_text

from . import route, run

AUTO = "auto"
CATEGORY = "advanced/attention"


def backend_choices() -> list[str]:
    return [AUTO, *lib_attn.BACKEND_IDS]


def parse_chain(backend: str, chain: str) -> list[str] | None:
    """The chain a node asks for: ``chain`` (comma-separated ids) when given, else ``backend``; None
    for Auto. ValueError names an unknown id and the valid ones."""
    text = (chain or "").strip() or ("" if backend == AUTO else backend)
    ids, unknown = parse_ids(text)
    if unknown:
        raise ValueError(f"unknown backend id {', '.join(map(repr, unknown))}; valid ids: "
                         f"{', '.join(lib_attn.BACKEND_IDS)} (or leave the chain empty for Auto)")
    return ids or None


def config_for(roles, backend: str, chain: str, strict: bool, fp32: str, tune: str = AUTO,
               guard: str | None = None, schedule: str = "") -> dict:
    """``lib_attn.configure`` arguments for the roles a node routes; ValueError for a bad value.
    ``guard`` None leaves the guard's mode in force; an empty ``schedule`` the schedule in force
    (``ATTN_COMFY_SCHEDULE``'s, if any), ``off`` none."""
    if fp32 not in (AUTO, *FP32_POLICIES):
        raise ValueError(f"fp32 {fp32!r} is not one of {AUTO}, {', '.join(FP32_POLICIES)}")
    if tune not in TUNE_MODES:
        raise ValueError(f"tune {tune!r} is not one of {', '.join(TUNE_MODES)}")
    if guard is not None and guard not in GUARD_MODES:
        raise ValueError(f"guard {guard!r} is not one of {', '.join(GUARD_MODES)}")
    ids = parse_chain(backend, chain)
    config = {"preference": {role: ids for role in roles} if ids else "auto", "strict": bool(strict), "tune": tune}
    if fp32 != AUTO:
        config["fp32"] = fp32
    if guard is not None:
        config["guard"] = guard
    if (schedule or "").strip():
        config["schedule"] = schedules.parse(schedule) or ""
    return config


def _validate(chain, schedule=""):
    """True, or what is wrong with the chain or the schedule (an input linked from another node
    arrives as None: it is checked when the node runs)."""
    try:
        parse_chain(AUTO, chain)
        schedules.parse(schedule or None)
    except ValueError as exc:
        return str(exc)
    return True


def backend_tooltip() -> str:
    """What Auto and an id mean, and which backends cannot run here (the page marks them in the list)."""
    return ("Auto: the fastest backend that takes each call; a backend id: that one first, falling back per "
            "call. " + unavailable_text())


def _common_inputs() -> dict:
    return {
        "backend": (backend_choices(), {"default": AUTO, "tooltip": backend_tooltip()}),
        "chain": ("STRING", {"default": "", "tooltip": "Optional: a chain of backend ids tried in order per call, "
                             "e.g. flash-attn,sdpa-cudnn (overrides backend)"}),
        "strict": ("BOOLEAN", {"default": False, "tooltip": "Stop the run instead of falling back when the first "
                               "backend cannot take a call"}),
        "fp32": ([AUTO, *FP32_POLICIES], {"default": AUTO, "tooltip": "fp32 inputs: cast (half-precision kernels, "
                                          "result cast back) or keep (fp32 kernels only)"}),
    }


SCHEDULE_TOOLTIP = (
    "Optional: which backends serve which calls, as rules 'conditions: backends' separated by ';', the first "
    "rule that holds taking the call, e.g. 'cross: sdpa; 0-20%: sdpa; 20-80%: sage3, sage; 80-100%: sdpa'. "
    "Conditions: A-B% (this sampler's steps done), sigma X-Y, self, cross, joint, first N, last N, blocks A-B. "
    "Calls no rule takes use the backend and chain above. Empty: the default schedule (ATTN_COMFY_SCHEDULE) if "
    "one is set; off: none.")


class AttentionBackend:
    """MODEL -> MODEL: the model's attention (every call of its forward) runs on the engine."""

    @classmethod
    def INPUT_TYPES(cls):
        inputs = {"model": ("MODEL",), **_common_inputs(),
                  "tune": (list(TUNE_MODES), {"default": AUTO, "tooltip": "Measure the backends that take each "
                                              "call kind on its first call and run the fastest (auto: on CUDA GPUs)"})}
        # Optional, so that a graph saved before it existed still runs (with the guard on).
        guard = {"guard": (list(GUARD_MODES), {"default": GUARD_MODES[0], "tooltip": "on: each kernel's first call "
                           "of each kind is checked against a reference, then its output is watched for NaN/inf; a "
                           "faulty call is recomputed on the next backend. full: every call checked (slower, to "
                           "find what makes a black image). off: nothing checked"}),
                    "schedule": ("STRING", {"default": "", "placeholder": schedules.EXAMPLE,
                                            "tooltip": SCHEDULE_TOOLTIP})}
        return {"required": inputs, "optional": guard}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = CATEGORY
    DESCRIPTION = "Runs the model's attention on the fastest kernel that takes each call, falling back per call."

    @classmethod
    def VALIDATE_INPUTS(cls, chain, schedule=""):
        return _validate(chain, schedule)

    def apply(self, model, backend, chain, strict, fp32, tune, guard=GUARD_MODES[0], schedule=""):
        config = config_for(("unet", "dit"), backend, chain, strict, fp32, tune, guard, schedule)
        return (route.route_model(model, config, None if fp32 == AUTO else fp32),)


class VAEAttentionBackend:
    """VAE -> VAE: the VAE's attention blocks run on the engine while this VAE encodes or decodes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae": ("VAE",), **_common_inputs()}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "apply"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Runs the VAE's attention on the engine (one head of 512 channels: flash-attn and "
                   "SageAttention cannot take it).")

    @classmethod
    def VALIDATE_INPUTS(cls, chain):
        return _validate(chain)

    def apply(self, vae, backend, chain, strict, fp32):
        return (route.route_vae(vae, config_for(("vae",), backend, chain, strict, fp32)),)


class AttentionReport:
    """Shows which kernels ran this run, how often, what fell back and why, time and peak VRAM."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "show"
    OUTPUT_NODE = True
    CATEGORY = CATEGORY
    DESCRIPTION = "The attention readout of this run; passes the images on."

    def show(self, images):
        report = run.report_for(images) or lib_attn.Report(
            ran_on="ComfyUI's own attention", notes=("no call of this run went through this extension",))
        run.send(report)
        return {"ui": {"text": readout.lines(report)}, "result": (images,)}


NODE_CLASS_MAPPINGS = {
    "FlashAttentionBackend": AttentionBackend,
    "FlashAttentionVAEBackend": VAEAttentionBackend,
    "FlashAttentionReport": AttentionReport,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "FlashAttentionBackend": "Attention backend",
    "FlashAttentionVAEBackend": "VAE attention backend",
    "FlashAttentionReport": "Attention report",
}
