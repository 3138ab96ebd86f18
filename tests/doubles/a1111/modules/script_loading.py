"""Double of modules/script_loading.py: load a file as a module by path (not entered in ``sys.modules``;
kept in ``loaded_scripts`` by path, as A1111 1.10, Forge, Forge Neo and reForge keep it; Forge Classic
keeps no such table), and run extensions' preload.py."""
import importlib.util
import os

from modules import errors

loaded_scripts = {}


def load_module(path):
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    loaded_scripts[path] = module
    return module


def preload_extensions(extensions_dir, parser, extension_list=None):
    """For each extension directory (sorted), load ``preload.py`` by path and call ``preload(parser)``;
    errors are reported, never raised."""
    if not os.path.isdir(extensions_dir):
        return
    names = extension_list if extension_list is not None else os.listdir(extensions_dir)
    for dirname in sorted(names):
        preload_script = os.path.join(extensions_dir, dirname, "preload.py")
        if not os.path.isfile(preload_script):
            continue
        try:
            module = load_module(preload_script)
            if hasattr(module, "preload"):
                module.preload(parser)
        except Exception:
            errors.report(f"Error running preload() for {preload_script}", exc_info=True)
