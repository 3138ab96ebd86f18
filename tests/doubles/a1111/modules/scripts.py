"""Double of modules/scripts.py: the Script base class, AlwaysVisible, and script loading.

``load_scripts(extension_dirs)`` does what A1111's does for an attention extension: clear callbacks, then
import every ``<ext>/scripts/*.py`` as a new module named after the file, with ``<ext>`` on sys.path only
while it loads. Calling it again is what "Reload UI" does.
"""
import os
import sys

from modules import errors, script_callbacks, script_loading

AlwaysVisible = object()

current_basedir = None
scripts_data = []      # (script class, path, basedir, module)
loaded_modules = []


class Script:
    name = None
    section = None
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    group = None
    infotext_fields = None
    paste_field_names = None

    def title(self):
        raise NotImplementedError()

    def ui(self, is_img2img):
        pass

    def show(self, is_img2img):
        return True

    def run(self, p, *args):
        pass

    def setup(self, p, *args):
        pass

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def before_process_batch(self, p, *args, **kwargs):
        pass

    def process_batch(self, p, *args, **kwargs):
        pass

    def process_before_every_sampling(self, p, *args, **kwargs):
        pass

    def postprocess_batch(self, p, *args, **kwargs):
        pass

    def postprocess_image(self, p, pp, *args):
        pass

    def postprocess(self, p, processed, *args):
        pass

    def before_component(self, component, **kwargs):
        pass

    def after_component(self, component, **kwargs):
        pass

    def describe(self):
        return ""

    def elem_id(self, item_id):
        title = "".join(c for c in self.title().lower().replace(" ", "_") if c.isalnum() or c == "_")
        return f"script_{'img2img' if self.is_img2img else 'txt2img'}_{title}_{item_id}"


def basedir():
    """The extension directory of the script being loaded (the webui root otherwise)."""
    from modules import paths_internal
    return current_basedir or paths_internal.script_path


def load_scripts(extension_dirs):
    """Clear callbacks, then import every ``scripts/*.py`` of each extension dir; returns the new modules."""
    global current_basedir
    script_callbacks.clear_callbacks()
    scripts_data.clear()
    loaded_modules.clear()
    for ext_dir in extension_dirs:
        scripts_dir = os.path.join(ext_dir, "scripts")
        if not os.path.isdir(scripts_dir):
            continue
        for filename in sorted(os.listdir(scripts_dir)):
            path = os.path.join(scripts_dir, filename)
            if not filename.endswith(".py") or not os.path.isfile(path):
                continue
            syspath = sys.path
            sys.path = [ext_dir] + sys.path   # only while loading, as A1111 does
            current_basedir = ext_dir
            try:
                module = script_loading.load_module(path)
                loaded_modules.append(module)
                for obj in module.__dict__.values():
                    if isinstance(obj, type) and issubclass(obj, Script) and obj is not Script:
                        scripts_data.append((obj, path, ext_dir, module))
            except Exception:
                errors.report(f"Error loading script: {filename}", exc_info=True)
            finally:
                sys.path = syspath
                current_basedir = None
    return list(loaded_modules)
