"""Double of reForge's ldm_patched/modules/args_parser.py: ComfyUI's parser inside the webui. At import it
parses nothing (``args_parsing`` is off); ``initialize_forge`` parses the command line with it before
anything reads ``args``.

The attention flags are one mutually exclusive group: ``--attention-split``, ``--attention-quad``,
``--attention-pytorch``, ``--use-sage-attention``, ``--use-sage-attention3``, ``--use-flash-attention``.
"""
import argparse

from ldm_patched.modules import options

parser = argparse.ArgumentParser()

attn_group = parser.add_mutually_exclusive_group()
attn_group.add_argument("--attention-split", action="store_true")
attn_group.add_argument("--attention-quad", action="store_true")
attn_group.add_argument("--attention-pytorch", action="store_true")
attn_group.add_argument("--use-sage-attention", action="store_true")
attn_group.add_argument("--use-sage-attention3", action="store_true")
attn_group.add_argument("--use-flash-attention", action="store_true")
parser.add_argument("--disable-xformers", action="store_true")

upcast = parser.add_mutually_exclusive_group()
upcast.add_argument("--force-upcast-attention", action="store_true")
upcast.add_argument("--dont-upcast-attention", action="store_true")

vram_group = parser.add_mutually_exclusive_group()
vram_group.add_argument("--always-gpu", action="store_true")
vram_group.add_argument("--always-cpu", action="store_true")
parser.add_argument("--cuda-malloc", action="store_true")
parser.add_argument("--cuda-device", type=int, default=None)

args = parser.parse_args() if options.args_parsing else parser.parse_args([])
