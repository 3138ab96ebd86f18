"""Double of ComfyUI's comfy/cli_args.py: parsed at import (the command line when ``options.args_parsing``,
else nothing). The attention flags are one mutually exclusive group."""
import argparse

from comfy import options

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
parser.add_argument("--listen", type=str, default="127.0.0.1")
parser.add_argument("--port", type=int, default=8188)

attn_group = parser.add_mutually_exclusive_group()
attn_group.add_argument("--use-split-cross-attention", action="store_true")
attn_group.add_argument("--use-quad-cross-attention", action="store_true")
attn_group.add_argument("--use-pytorch-cross-attention", action="store_true")
attn_group.add_argument("--use-sage-attention", action="store_true")
attn_group.add_argument("--use-flash-attention", action="store_true")
parser.add_argument("--disable-xformers", action="store_true")

upcast = parser.add_mutually_exclusive_group()
upcast.add_argument("--force-upcast-attention", action="store_true")
upcast.add_argument("--dont-upcast-attention", action="store_true")

args = parser.parse_args() if options.args_parsing else parser.parse_args([])
