"""``python -m lib_attn doctor|bench|tune``: the commands live in ``lib_attn.commands``."""
import sys

from lib_attn.commands.cli import build_parser, main  # noqa: F401 - build_parser for callers

if __name__ == "__main__":
    sys.exit(main())
