"""Command-line flags of sd-webui-flash-attention. The webui loads this file by path before parsing
its arguments; it imports nothing heavy (no torch) and adds flags.

Backend ids are checked when the extension loads, where the engine is importable: an unknown id is
reported with the list of valid ids and the flag is ignored.

On the ldm_patched line (reForge) it also claims the host's own ``--use-flash-attention`` /
``--use-sage-attention`` / ``--use-sage-attention3`` when their package is missing and the host has
not imported its attention module yet (``host_attn/startup_flags.py``): the webui then starts instead
of exiting, and the extension puts that kernel first, falling back per call.
"""
import argparse
import importlib.util
import os
import sys

GROUP_TITLE = "sd-webui-flash-attention"

_FALLBACK = ("A call it cannot take (all of them when it cannot run here) falls back to the next backend of "
             "the chain (ending in plain PyTorch) and is counted with the reason; see --attn-strict.")

FLAGS = (
    ("--opt-flash-attention", dict(
        action="store_true",
        help="Use flash-attn (FlashAttention 2/3) for UNet and DiT attention; 'Automatic' picks it. "
             "Head dims above 256 (VAE), fp32 under --attn-fp32 keep, and non-CUDA calls fall back. " + _FALLBACK)),
    ("--opt-cudnn-attention", dict(
        action="store_true",
        help="Use PyTorch's cuDNN attention for UNet and DiT attention; 'Automatic' picks it. "
             + _FALLBACK)),
    ("--opt-efficient-attention", dict(
        action="store_true",
        help="Use PyTorch's memory-efficient attention for UNet and DiT attention; 'Automatic' picks it. " + _FALLBACK)),
    ("--opt-sage-attention", dict(
        action="store_true",
        help="Use SageAttention (quantised QK) for UNet and DiT attention; 'Automatic' picks it. "
             "Head dims it does not support (SD1.5's 160, the VAE's 512) fall back. " + _FALLBACK)),
    ("--attn-backend", dict(
        metavar="ID[,ID...]", default=None,
        help="Explicit backend chain for UNet and DiT attention, tried in order per call, e.g. "
             "'flash-attn,sdpa-cudnn', using the engine's backend ids (an unknown id is reported at startup "
             "with the valid ones, and the flag ignored). Overrides the --opt-*-attention flags. " + _FALLBACK)),
    ("--attn-vae-backend", dict(
        metavar="ID[,ID...]", default=None,
        help="Explicit backend chain for VAE attention (one head of 512 channels), same ids as "
             "--attn-backend. Without it the VAE uses the engine's default chain. " + _FALLBACK)),
    ("--attn-fp32", dict(
        choices=("cast", "keep"), default=None,
        help="fp32 attention inputs (--no-half, upcast attention): 'cast' runs half-only kernels in "
             "bf16/fp16 and casts the result back; 'keep' stays fp32 and falls back to a kernel that "
             "takes fp32. Default: cast, or keep when the webui asks for upcast attention.")),
    ("--attn-tune", dict(
        choices=("on", "off"), default=None,
        help="Tuning: on the first call of each call kind, time every backend that can take it (checking its "
             "output) and run the fastest correct one; results are kept across runs in "
             "$LIB_ATTN_CACHE_DIR/tuning.json (default ~/.cache/lib_attn). 'on' measures on every device, 'off' "
             "keeps the fixed order. Default: on for CUDA GPUs. A single chosen backend is never re-ranked; "
             "one that fails the check falls back like any other.")),
    ("--attn-guard", dict(
        choices=("on", "full", "off"), default=None,
        help="Output guard: 'on' (default) checks each kernel's first call of each call kind against a reference "
             "and then watches its output for NaN/inf (every call of an approximate kernel such as SageAttention, "
             "a sample of an exact one); a faulty call is recomputed on the next backend, which that call kind "
             "falls back to from then on; 'full' checks every call (slower: for chasing a black image); 'off' "
             "checks nothing.")),
    ("--attn-schedule", dict(
        metavar="TEXT", default=None,
        help="Default schedule: which backends serve which steps, blocks and roles, on one line, e.g. "
             "'0-20%%: sdpa; 20-80%%: sage; 80-100%%: sdpa; vae: sdpa'. Rules are 'conditions: backends'; the "
             "first whose conditions hold takes a call, calls no rule takes keep the other settings; each rule's "
             "backends fall back per call as --attn-backend's do. A bad "
             "schedule is reported at startup with the rule and part that are wrong, and the flag ignored. "
             "The setting and the per-generation field override it ('off': none).")),
    ("--attn-sparse", dict(
        metavar="TEXT", default=None,
        help="Default sparse attention for long self-attention calls, held to an error budget, on one line: a "
             "method (auto, sol, block-sparse) then name=value fields, e.g. 'sol, budget=0.15, min_tokens=12288, "
             "topk=0.1, dense=0-20%%; first 1'. budget: the largest relative error of a call against exact "
             "attention, in (0, 1]; min_tokens: shorter calls stay dense; topk or threshold: the routing; "
             "dense: windows that stay dense. A call kind over the budget falls back to dense attention, counted "
             "with its reason. Bad settings are reported at startup naming the value, and the "
             "flag ignored. The setting and the per-generation field override it ('off': none).")),
    ("--attn-strict", dict(
        action="store_true",
        help="Raise an error instead of falling back when the chosen backend cannot take a call "
             "(for testing a backend; generation stops).")),
)


def _claim_startup_flags() -> None:
    host_args = getattr(sys.modules.get("ldm_patched.modules.args_parser"), "args", None)
    if host_args is None or "ldm_patched.ldm.modules.attention" in sys.modules:
        return  # not that line, or too late: the host has chosen its attention already
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_attn", "startup_flags.py")
    spec = importlib.util.spec_from_file_location("flash_attention_startup_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for message in module.claim(host_args):
        print(f"[flash-attention] {message}")


def preload(parser: argparse.ArgumentParser) -> None:
    _claim_startup_flags()
    group = parser.add_argument_group(GROUP_TITLE)
    for flag, kwargs in FLAGS:
        try:
            group.add_argument(flag, **kwargs)
        except argparse.ArgumentError:
            # already defined (preload ran twice, or another extension owns the name): keep theirs
            pass
