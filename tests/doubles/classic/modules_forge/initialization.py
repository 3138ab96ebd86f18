"""Double of Forge Classic's modules_forge/initialization.py: ``initialize_forge`` parses ldm_patched's own
arguments from the command line before anything reads them, then loads model management."""


def initialize_forge():
    from ldm_patched.modules import args_parser

    args_parser.args, _ = args_parser.parser.parse_known_args()
    import ldm_patched.modules.model_management  # noqa: F401
