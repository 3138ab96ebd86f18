"""Double of Forge Classic's modules/cmd_args.py: extends ldm_patched's parser (so ``shared.cmd_opts`` holds
its flags too) with A1111's flags, without A1111's ``--opt-*`` attention flags, and with Classic's
``--sage`` beside ``--xformers`` (both make the launcher install the package; the attention module
uses it when it imports)."""
from ldm_patched.modules import args_parser

parser = args_parser.parser
parser.add_argument("--xformers", action="store_true")
parser.add_argument("--sage", action="store_true")
parser.add_argument("--force-enable-xformers", action="store_true")
parser.add_argument("--no-half", action="store_true")
parser.add_argument("--no-half-vae", action="store_true")
parser.add_argument("--upcast-sampling", action="store_true")
parser.add_argument("--skip-torch-cuda-test", action="store_true")
parser.add_argument("--skip-install", action="store_true")
parser.add_argument("--skip-prepare-environment", action="store_true")
parser.add_argument("--disable-all-extensions", action="store_true")
parser.add_argument("--gradio-auth", type=str, default=None)
parser.add_argument("--gradio-auth-path", type=str, default=None)
parser.add_argument("--api", action="store_true")
parser.add_argument("--api-auth", type=str, default=None)
parser.add_argument("--nowebui", action="store_true")
parser.add_argument("--use-cpu", nargs="+", default=[])
parser.add_argument("--hide-ui-dir-config", action="store_true")
parser.add_argument("--no-prompt-history", action="store_true")
