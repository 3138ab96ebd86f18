"""Double of modules/cmd_args.py: the attention, precision and launcher flags of host-contract A5.

On Forge the real file extends ``backend.args.parser``; this double does the same when ``backend.args``
is importable (Forge mode) and builds its own parser otherwise.
"""
import argparse

try:
    from backend.args import parser
except ImportError:
    parser = argparse.ArgumentParser()

parser.add_argument("--xformers", action="store_true")
parser.add_argument("--force-enable-xformers", action="store_true")
parser.add_argument("--xformers-flash-attention", action="store_true")
parser.add_argument("--opt-split-attention", action="store_true")
parser.add_argument("--opt-sub-quad-attention", action="store_true")
parser.add_argument("--sub-quad-q-chunk-size", type=int, default=1024)
parser.add_argument("--sub-quad-kv-chunk-size", type=int, default=None)
parser.add_argument("--sub-quad-chunk-threshold", type=int, default=None)
parser.add_argument("--opt-split-attention-invokeai", action="store_true")
parser.add_argument("--opt-split-attention-v1", action="store_true")
parser.add_argument("--opt-sdp-attention", action="store_true")
parser.add_argument("--opt-sdp-no-mem-attention", action="store_true")
parser.add_argument("--disable-opt-split-attention", action="store_true")
parser.add_argument("--no-half", action="store_true")
parser.add_argument("--no-half-vae", action="store_true")
parser.add_argument("--upcast-sampling", action="store_true")
parser.add_argument("--precision", choices=["full", "half", "autocast"], default="autocast")
parser.add_argument("--medvram", action="store_true")
parser.add_argument("--lowvram", action="store_true")
parser.add_argument("--use-cpu", nargs="+", default=[])
parser.add_argument("--skip-torch-cuda-test", action="store_true")
parser.add_argument("--skip-install", action="store_true")
parser.add_argument("--skip-prepare-environment", action="store_true")
parser.add_argument("--disable-all-extensions", action="store_true")
parser.add_argument("--api", action="store_true")
parser.add_argument("--api-auth", type=str, default=None)
parser.add_argument("--gradio-auth", type=str, default=None)
parser.add_argument("--gradio-auth-path", type=str, default=None)
parser.add_argument("--nowebui", action="store_true")
parser.add_argument("--hide-ui-dir-config", action="store_true")
parser.add_argument("--no-prompt-history", action="store_true")
