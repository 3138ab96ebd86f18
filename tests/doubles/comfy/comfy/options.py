"""Double of ComfyUI's comfy/options.py: main.py switches argument parsing on before importing cli_args."""
args_parsing = False


def enable_args_parsing(enable=True):
    global args_parsing
    args_parsing = enable
