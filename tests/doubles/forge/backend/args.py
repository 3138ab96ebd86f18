"""Double of Forge's backend/args.py: the one parser (extended by modules/cmd_args), parsed at import."""
import argparse
import sys

parser = argparse.ArgumentParser()

attn_group = parser.add_mutually_exclusive_group()
attn_group.add_argument("--attention-split", action="store_true")
attn_group.add_argument("--attention-quad", action="store_true")
attn_group.add_argument("--attention-pytorch", action="store_true")

upcast = parser.add_mutually_exclusive_group()
upcast.add_argument("--force-upcast-attention", action="store_true")
upcast.add_argument("--disable-attention-upcast", action="store_true")

parser.add_argument("--disable-xformers", action="store_true")
parser.add_argument("--always-cpu", action="store_true")
parser.add_argument("--always-gpu", action="store_true")
parser.add_argument("--all-in-fp32", action="store_true")
parser.add_argument("--unet-in-bf16", action="store_true")
parser.add_argument("--vae-in-fp32", action="store_true")
parser.add_argument("--pytorch-deterministic", action="store_true")

#: Parsed once, at import: flags an extension adds later (preload.py) never show up here.
args = parser.parse_known_args(sys.argv[1:])[0]

dynamic_args = dict(embedding_dir="./embeddings", emphasis_name="original")
