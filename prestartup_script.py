"""Run by ComfyUI before it imports its own modules (its ``prestartup_script.py`` hook); the webuis
never run it. It loads only ``host_attn/startup_flags.py`` (standard library, never torch: ComfyUI sets
up its devices after this), which claims ComfyUI's own ``--use-flash-attention`` /
``--use-sage-attention`` (see that module).
"""
import importlib.util
import os
import sys


def _claim_flags() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_attn", "startup_flags.py")
    spec = importlib.util.spec_from_file_location("flash_attention_startup_flags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for message in module.claim(getattr(sys.modules.get("comfy.cli_args"), "args", None)):
        print(f"[flash-attention] {message}")


_claim_flags()
