"""The extension's settings in Settings > Optimizations: the options the webui shows and stores.

Every key starts with ``flash_attn_`` (``settings.stored`` has the keys, their defaults and what a
stored value means). Each option's onchange pushes the values to the engine at once, and they are read again at
every generation, so a change applies to the next one without a restart. "Auto" leaves the choice to
the weaker layers: command-line flags, the A1111 optimizer, the engine default.
"""
from __future__ import annotations

from lib_attn.schedule import EXAMPLE as SCHEDULE_EXAMPLE, TERMS
from lib_attn.sparse import EXAMPLE as SPARSE_EXAMPLE, methods as sparse_methods

from host_attn.status import WEBUI_INSTALL_HINT, unavailable_text

from ..settings import choices, stored
from ..settings.stored import (AUTO, FP32_CHOICES, GUARD_CHOICES, KEY_AVAILABILITY, KEY_BACKEND, KEY_FP32, KEY_GUARD,
                               KEY_READOUT, KEY_SCHEDULE, KEY_SPARSE, KEY_STRICT, KEY_TUNE, KEY_VAE_BACKEND, TUNE_CHOICES)

SECTION = ("optimizations", "Optimizations", "sd")


INFO = {
    # The whole line stays within 300 characters on a machine without a GPU (the grouped text is ~230).
    KEY_BACKEND: lambda: "Auto: your flag or optimizer, else the fastest per call. " + unavailable_text(WEBUI_INSTALL_HINT),
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
        from . import components

        out = {"info": INFO[key]()}
        if key == KEY_FP32:
            out["choices"] = list(FP32_CHOICES)
        else:
            out["choices"] = choices.choices(AUTO, pairs=components.gradio_major() >= 4)
        return out

    return args


def _on_change():
    stored.apply_settings()


def options(shared) -> dict:
    """The ``OptionInfo`` entries, keyed by option name, stamped with the Optimizations section."""
    import gradio as gr

    from . import components

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
        KEY_GUARD: OptionInfo(AUTO, "Guard: check each kernel's output and recompute a faulty call on the next one",
                              gr.Radio, {"choices": list(GUARD_CHOICES)}, onchange=_on_change)
        .info("Auto: the --attn-guard flag, else on. on: each kernel's first call of each kind is checked against a "
              "reference, then its output is watched for NaN/inf; full: every call checked (slower, for chasing a "
              "black image); off: nothing checked. Forget remembered failures with: python -m lib_attn tune --clear"),
        KEY_SCHEDULE: OptionInfo("", "Attention schedule: which backends serve which steps, blocks and roles",
                                 gr.Textbox, {"placeholder": SCHEDULE_EXAMPLE}, onchange=_on_change)
        .info("One line of rules 'conditions: backends', the first that holds takes a call, e.g. "
              f"'{SCHEDULE_EXAMPLE}'. Conditions: {', '.join(TERMS)}. Empty: the --attn-schedule flag, else none; "
              "off: none. A schedule with a mistake is not applied and generations are refused until it is fixed."),
        KEY_SPARSE: OptionInfo("", "Sparse attention for long self-attention calls, held to an error budget",
                               gr.Textbox, {"placeholder": SPARSE_EXAMPLE}, onchange=_on_change)
        .info(f"A method ({', '.join(sparse_methods())}) then name=value fields, e.g. '{SPARSE_EXAMPLE}'. budget: "
              "the largest relative error of a call against exact attention, in (0, 1]; min_tokens: shorter calls "
              "stay dense; topk (a keep fraction of key blocks) or threshold (the method's own); dense: windows "
              "that stay dense. Empty: the --attn-sparse flag, else none; off: none. Settings with a mistake are "
              "not applied and generations are refused until they are fixed."),
        KEY_READOUT: OptionInfo(True, "Show which attention kernels ran, their fallbacks, time and VRAM under the image",
                                gr.Checkbox),
    }
    table = components.availability_option(shared)
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
