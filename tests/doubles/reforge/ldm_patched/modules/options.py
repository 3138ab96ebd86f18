"""Double of reForge's ldm_patched/modules/options.py: whether the parser reads the command line at import."""
args_parsing = False


def enable_args_parsing(enable=True):
    global args_parsing
    args_parsing = enable
