"""Double of reForge's modules/initialize.py, the part an extension meets: ``initialize_rest`` loads the
scripts (callbacks cleared first); A1111's optimizer list is commented out there. Calling it again after
``script_callbacks.script_unloaded_callback()`` is "Reload UI"."""
from modules import scripts


def initialize_rest(extension_dirs=(), reload_script_modules=False):
    scripts.load_scripts(list(extension_dirs))
