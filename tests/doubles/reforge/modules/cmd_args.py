"""Double of reForge's modules/cmd_args.py: extends ldm_patched's parser (so ``shared.cmd_opts`` holds its
``--use-*-attention`` flags too) with A1111's flags."""
from ldm_patched.modules import args_parser

parser = args_parser.parser

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
parser.add_argument("--nowebui", action="store_true")
