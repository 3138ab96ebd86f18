"""Double of Forge Classic's ldm_patched/modules/args_parser.py: parses nothing at import
(``args = parser.parse_args([])``); ``initialize_forge`` parses the command line with it."""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--gpu-device-id", type=int, default=None, metavar="DEVICE_ID")
parser.add_argument("--disable-attention-upcast", action="store_true")

attn_group = parser.add_mutually_exclusive_group()
attn_group.add_argument("--attention-split", action="store_true")
attn_group.add_argument("--attention-quad", action="store_true")
attn_group.add_argument("--attention-pytorch", action="store_true")

vram_group = parser.add_mutually_exclusive_group()
vram_group.add_argument("--always-gpu", action="store_true")
vram_group.add_argument("--always-cpu", action="store_true")
parser.add_argument("--disable-xformers", action="store_true")
parser.add_argument("--disable-sage", action="store_true")
parser.add_argument("--cuda-malloc", action="store_true")

args = parser.parse_args([])
