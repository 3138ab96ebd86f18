"""Double of modules/shared_cmd_options.py: run every extension's preload, then parse sys.argv."""
import os
import sys

from modules import cmd_args, paths_internal, script_loading

parser = cmd_args.parser

script_loading.preload_extensions(paths_internal.extensions_dir, parser)
script_loading.preload_extensions(paths_internal.extensions_builtin_dir, parser)

if os.environ.get("IGNORE_CMD_ARGS_ERRORS", None) is None:
    cmd_opts = parser.parse_args(sys.argv[1:])
else:
    cmd_opts, _ = parser.parse_known_args(sys.argv[1:])
