"""The custom nodes: Attention backend (MODEL -> MODEL), VAE attention backend (VAE -> VAE) and
Attention report (shows what the run's attention did).

Choices list only valid values, which ComfyUI checks itself ("Value not in list", on the input that
holds the value). The text typed by hand (the chain, the schedule, the sparse settings) is checked by
``VALIDATE_INPUTS`` before the graph runs. ComfyUI (0.8.0 to 0.19.3) reports a failed check once for
every input the method takes, each with the same text, and has no way to fail one input alone; so the
text names the input that holds each bad value, one line each (``chain: unknown backend id …``,
``schedule rule 2 (…): …``, ``sparse method …``), and the page (``web/flash_attention.js``) keeps each
line on the input it names only. The values are checked again when the node runs, before anything of
them is put in force (the API can skip the page; a linked value is known only then).
"""
from __future__ import annotations

import lib_attn
from lib_attn import schedule as schedules
from lib_attn import sparse as sparse_settings
from lib_attn.config import FP32_POLICIES, GUARD_MODES, TUNE_MODES

from lib_attn import readout
from host_attn.node_options import (AUTO, CHAIN_TOOLTIP, FP32_TOOLTIP, GUARD_TOOLTIP, STRICT_TOOLTIP, TUNE_TOOLTIP,
                                    backend_choices, backend_tooltip, config_for, problems,
                                    schedule_tooltip, sparse_tooltip)

from . import route, run

CATEGORY = "advanced/attention"


def _validate(**values):
    """True, or what is wrong (ComfyUI's answer to VALIDATE_INPUTS): a line per input holding a bad value,
    each starting with the input's name."""
    found = problems(**values)
    lines = [text if text.startswith(f"{name} ") else f"{name}: {text}" for name, text in found.items()]
    return "\n".join(lines) or True


def _common_inputs() -> dict:
    return {
        "backend": (backend_choices(), {"default": AUTO, "tooltip": backend_tooltip()}),
        "chain": ("STRING", {"default": "", "tooltip": CHAIN_TOOLTIP}),
        "strict": ("BOOLEAN", {"default": False, "tooltip": STRICT_TOOLTIP}),
        "fp32": ([AUTO, *FP32_POLICIES], {"default": AUTO, "tooltip": FP32_TOOLTIP}),
    }


SCHEDULE_TOOLTIP = schedule_tooltip("ATTN_COMFY_SCHEDULE")
SPARSE_TOOLTIP = sparse_tooltip("ATTN_COMFY_SPARSE")


class AttentionBackend:
    """MODEL -> MODEL: the model's attention (every call of its forward) runs on the engine."""

    @classmethod
    def INPUT_TYPES(cls):
        inputs = {"model": ("MODEL",), **_common_inputs(),
                  "tune": (list(TUNE_MODES), {"default": AUTO, "tooltip": TUNE_TOOLTIP})}
        # Optional, so that a graph saved before it existed still runs (with the guard on).
        guard = {"guard": (list(GUARD_MODES), {"default": GUARD_MODES[0], "tooltip": GUARD_TOOLTIP}),
                    "schedule": ("STRING", {"default": "", "placeholder": schedules.EXAMPLE,
                                            "tooltip": SCHEDULE_TOOLTIP}),
                    "sparse": ("STRING", {"default": "", "placeholder": sparse_settings.EXAMPLE,
                                          "tooltip": SPARSE_TOOLTIP})}
        return {"required": inputs, "optional": guard}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = CATEGORY
    DESCRIPTION = "Runs the model's attention on the fastest kernel that takes each call, falling back per call."

    @classmethod
    def VALIDATE_INPUTS(cls, chain, schedule="", sparse=""):
        return _validate(chain=chain, schedule=schedule, sparse=sparse)

    def apply(self, model, backend, chain, strict, fp32, tune, guard=GUARD_MODES[0], schedule="", sparse=""):
        config = config_for(("unet", "dit"), backend, chain, strict, fp32, tune, guard, schedule, sparse)
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
        return _validate(chain=chain)

    def apply(self, vae, backend, chain, strict, fp32):
        return (route.route_vae(vae, config_for(("vae",), backend, chain, strict, fp32)),)


#: Under the global route every sampling and VAE pass runs on the engine, so a prompt without a routed call
#: ran none: its images were made by an earlier prompt (ComfyUI served them from its cache, and a node such
#: as an image transform made new images of them, which no run made) or by no model at all.
NOTHING_RAN = ("no sampling or VAE pass of this prompt ran attention (under ATTN_COMFY_ROUTE each one runs "
               "on this extension): these images were made by an earlier prompt, whose report is in "
               "ComfyUI's history, or by no model")


def _no_routed_call() -> lib_attn.Report:
    """The report of a prompt that made no routed call and whose images no run made."""
    if route.routing().routed:
        return lib_attn.Report(notes=(NOTHING_RAN,))
    return lib_attn.Report(ran_on="ComfyUI's own attention",
                           notes=("no call of this run went through this extension",))


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
        report = run.report_for(images) or _no_routed_call()
        run.send(report, run.prompt_id())
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
