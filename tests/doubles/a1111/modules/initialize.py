"""Double of the part of modules/initialize.py an attention extension meets: ``initialize_rest``.

It loads the scripts of ``extension_dirs`` (clearing callbacks first) and rebuilds the optimizer list;
calling it again after ``script_callbacks.script_unloaded_callback()`` is what "Reload UI" does. As in
A1111, ``current_optimizer`` is not re-applied.
"""
from modules import initialize_util, scripts


def initialize_rest(extension_dirs=(), reload_script_modules=False):
    scripts.load_scripts(list(extension_dirs))
    from modules import script_callbacks, sd_hijack, sd_hijack_optimizations
    if hasattr(sd_hijack, "list_optimizers"):
        # the built-ins register last, so extension optimizers come first when priorities tie
        script_callbacks.on_list_optimizers(sd_hijack_optimizations.list_optimizers)
        sd_hijack.list_optimizers()
    initialize_util.configure_opts_onchange()
