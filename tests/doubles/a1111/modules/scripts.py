"""Double of modules/scripts.py: the Script base class, AlwaysVisible, script loading and the runner.

``load_scripts(extension_dirs)`` does what A1111's does for an attention extension: clear callbacks, then
import every ``<ext>/scripts/*.py`` as a new module named after the file, with ``<ext>`` on sys.path only
while it loads. Calling it again is what "Reload UI" does.

``ScriptRunner`` (``scripts_txt2img`` / ``scripts_img2img``) does what A1111's does for always-on scripts:
``initialize_scripts`` makes one instance per script, ``setup_ui`` builds their UI (inside a gr.Blocks)
and gives each its ``args_from``/``args_to``, ``after_component`` runs the callbacks scripts registered
with ``on_after_component`` for that elem_id, and ``before_process``, ``process``, ``before_process_batch``,
``process_batch``, ``postprocess_batch``, ``postprocess_image`` (each image, after its batch's
``postprocess_batch`` and before its infotext is written) and ``postprocess`` call each script with its slice of ``p.script_args``, catching and reporting (``errors.report``) each script's exception and going on.
"""
import os
import sys
from dataclasses import dataclass

from modules import errors, script_callbacks, script_loading

AlwaysVisible = object()


@dataclass
class OnComponent:
    component: object

class PostprocessImageArgs:
    def __init__(self, image):
        self.image = image


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
    on_after_component_elem_id = None
    controls = None

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

    def on_after_component(self, callback, *, elem_id):
        """``callback(OnComponent)`` runs right after the component with ``elem_id`` is created."""
        if self.on_after_component_elem_id is None:
            self.on_after_component_elem_id = []
        self.on_after_component_elem_id.append((elem_id, callback))

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


class ScriptRunner:
    def __init__(self):
        self.scripts = []
        self.alwayson_scripts = []
        self.inputs = [None]
        self.on_after_component_elem_id = {}

    def initialize_scripts(self, is_img2img):
        self.scripts.clear()
        self.alwayson_scripts.clear()
        for script_class, path, _, _ in scripts_data:
            try:
                script = script_class()
            except Exception:
                errors.report(f"Error # failed to initialize Script {path}: ", exc_info=True)
                continue
            script.filename = path
            script.is_txt2img = not is_img2img
            script.is_img2img = is_img2img
            script.tabname = "img2img" if is_img2img else "txt2img"
            if script.show(is_img2img) is AlwaysVisible:
                script.alwayson = True
                self.scripts.append(script)
                self.alwayson_scripts.append(script)
        self.apply_on_before_component_callbacks()

    def apply_on_before_component_callbacks(self):
        for script in self.scripts:
            on_after = script.on_after_component_elem_id or []
            for elem_id, callback in on_after:
                self.on_after_component_elem_id.setdefault(elem_id, []).append((callback, script))
            on_after.clear()

    def setup_ui(self):
        """Build every script's UI in the current gr.Blocks; the callbacks registered meanwhile apply to
        the components created after this (the output panel). Each script's ``infotext_fields`` and
        ``paste_field_names`` are gathered, in the scripts' order, as A1111's runner gathers them."""
        self.inputs = [None]
        self.infotext_fields = []
        self.paste_field_names = []
        for script in self.scripts:
            script.args_from = script.args_to = len(self.inputs)
            try:
                controls = script.ui(script.is_img2img)
            except Exception:
                errors.report(f"Error creating UI for {script.filename}: ", exc_info=True)
                continue
            script.controls = controls
            if controls is None:
                continue
            script.name = script.title().lower()
            self.inputs.extend(controls)
            script.args_to = len(self.inputs)
            if script.infotext_fields is not None:
                self.infotext_fields += script.infotext_fields
            if script.paste_field_names is not None:
                self.paste_field_names += script.paste_field_names
        self.apply_on_before_component_callbacks()
        return self.inputs

    def after_component(self, component, **kwargs):
        for callback, script in self.on_after_component_elem_id.get(getattr(component, "elem_id", None), []):
            try:
                callback(OnComponent(component=component))
            except Exception:
                errors.report(f"Error running on_after_component: {script.filename}", exc_info=True)

    def _each(self, hook, p, *args, **kwargs):
        for script in self.alwayson_scripts:
            try:
                getattr(script, hook)(p, *args, *p.script_args[script.args_from:script.args_to], **kwargs)
            except Exception:
                errors.report(f"Error running {hook}: {script.filename}", exc_info=True)

    def before_process(self, p):
        self._each("before_process", p)

    def process(self, p):
        self._each("process", p)

    def before_process_batch(self, p, **kwargs):
        self._each("before_process_batch", p, **kwargs)

    def process_batch(self, p, **kwargs):
        self._each("process_batch", p, **kwargs)

    def postprocess_batch(self, p, images, **kwargs):
        self._each("postprocess_batch", p, images=images, **kwargs)

    def postprocess_image(self, p, pp):
        self._each("postprocess_image", p, pp)

    def postprocess(self, p, processed):
        for script in self.alwayson_scripts:
            try:
                script.postprocess(p, processed, *p.script_args[script.args_from:script.args_to])
            except Exception:
                errors.report(f"Error running postprocess: {script.filename}", exc_info=True)


scripts_txt2img = ScriptRunner()
scripts_img2img = ScriptRunner()
scripts_current = None
