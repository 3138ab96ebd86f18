"""Double of Forge Neo's modules/cmd_args.py: extends ``backend.args.parser`` (which already has Neo's
attention flags, ``--xformers`` included) with the webui's launcher, server and auth flags. Neo has no
A1111 attention flags (``--opt-sdp-attention``, ``--no-half``, …)."""
from backend.args import parser

parser.add_argument("--skip-torch-cuda-test", action="store_true")
parser.add_argument("--reinstall-xformers", action="store_true")
parser.add_argument("--skip-prepare-environment", action="store_true")
parser.add_argument("--skip-install", action="store_true")
parser.add_argument("--gradio-auth", type=str, default=None)
parser.add_argument("--gradio-auth-path", type=str, default=None)
parser.add_argument("--api", action="store_true")
parser.add_argument("--api-auth", type=str, default=None)
parser.add_argument("--nowebui", action="store_true")
parser.add_argument("--skip-version-check", action="store_true")
parser.add_argument("--disable-all-extensions", action="store_true")
parser.add_argument("--use-cpu", nargs="+", default=[])
parser.add_argument("--hide-ui-dir-config", action="store_true")
parser.add_argument("--no-prompt-history", action="store_true")
