"""Double of modules/script_callbacks.py: registrars ``on_*(callback, *, name=None)`` and their runners.

Registering records the script file being loaded (``scripts.current_basedir``-like bookkeeping is
reduced to the callback's module file). Runners report exceptions through ``errors`` and go on.
"""
import dataclasses
import inspect
import os

from modules import errors


@dataclasses.dataclass
class ScriptCallback:
    script: str
    callback: object
    name: str = None


class ImageSaveParams:
    def __init__(self, image, p, filename, pnginfo):
        self.image = image
        self.p = p
        self.filename = filename
        self.pnginfo = pnginfo


class CFGDenoiserParams:
    def __init__(self, x, image_cond, sigma, sampling_step, total_sampling_steps, text_cond, text_uncond, denoiser=None):
        self.x = x
        self.image_cond = image_cond
        self.sigma = sigma
        self.sampling_step = sampling_step
        self.total_sampling_steps = total_sampling_steps
        self.text_cond = text_cond
        self.text_uncond = text_uncond
        self.denoiser = denoiser


CATEGORIES = (
    "callbacks_app_started", "callbacks_model_loaded", "callbacks_ui_tabs", "callbacks_ui_train_tabs",
    "callbacks_ui_settings", "callbacks_before_image_saved", "callbacks_image_saved", "callbacks_infotext_pasted",
    "callbacks_script_unloaded", "callbacks_before_ui", "callbacks_list_optimizers", "callbacks_before_reload",
    "callbacks_cfg_denoiser",
)
callback_map = {name: [] for name in CATEGORIES}


def clear_callbacks():
    for callback_list in callback_map.values():
        callback_list.clear()


def add_callback(callbacks, fun, *, name=None, category="unknown"):
    stack = [x for x in inspect.stack() if x.filename != __file__]
    filename = stack[0].filename if stack else "unknown file"
    unique = f"{os.path.basename(filename)}/{category}" + (f"/{name}" if name else "")
    callbacks.append(ScriptCallback(filename, fun, unique))


def remove_callbacks_for_function(callback_func):
    for callback_list in callback_map.values():
        for callback_to_remove in [cb for cb in callback_list if cb.callback == callback_func]:
            callback_list.remove(callback_to_remove)


def _run(category, *args):
    for c in list(callback_map[category]):
        try:
            c.callback(*args)
        except Exception as e:
            errors.report(f"Error executing callback {c.name}: {e}", exc_info=True)


def app_started_callback(demo, app):
    _run("callbacks_app_started", demo, app)


def model_loaded_callback(sd_model):
    _run("callbacks_model_loaded", sd_model)


def ui_settings_callback():
    _run("callbacks_ui_settings")


def before_image_saved_callback(params):
    _run("callbacks_before_image_saved", params)


def image_saved_callback(params):
    _run("callbacks_image_saved", params)


def cfg_denoiser_callback(params):
    _run("callbacks_cfg_denoiser", params)


def before_reload_callback():
    _run("callbacks_before_reload")


def infotext_pasted_callback(infotext, params):
    _run("callbacks_infotext_pasted", infotext, params)


def script_unloaded_callback():
    for c in reversed(callback_map["callbacks_script_unloaded"]):
        try:
            c.callback()
        except Exception as e:
            errors.report(f"Error executing callback {c.name}: {e}", exc_info=True)


def list_optimizers_callback():
    res = []
    for c in callback_map["callbacks_list_optimizers"]:
        try:
            c.callback(res)
        except Exception as e:
            errors.report(f"Error executing callback {c.name}: {e}", exc_info=True)
    return res


def on_app_started(callback, *, name=None):
    add_callback(callback_map["callbacks_app_started"], callback, name=name, category="app_started")


def on_model_loaded(callback, *, name=None):
    add_callback(callback_map["callbacks_model_loaded"], callback, name=name, category="model_loaded")


def on_ui_settings(callback, *, name=None):
    add_callback(callback_map["callbacks_ui_settings"], callback, name=name, category="ui_settings")


def on_before_image_saved(callback, *, name=None):
    add_callback(callback_map["callbacks_before_image_saved"], callback, name=name, category="before_image_saved")


def on_image_saved(callback, *, name=None):
    add_callback(callback_map["callbacks_image_saved"], callback, name=name, category="image_saved")


def on_infotext_pasted(callback, *, name=None):
    add_callback(callback_map["callbacks_infotext_pasted"], callback, name=name, category="infotext_pasted")


def on_script_unloaded(callback, *, name=None):
    add_callback(callback_map["callbacks_script_unloaded"], callback, name=name, category="script_unloaded")


def on_before_ui(callback, *, name=None):
    add_callback(callback_map["callbacks_before_ui"], callback, name=name, category="before_ui")


def on_list_optimizers(callback, *, name=None):
    add_callback(callback_map["callbacks_list_optimizers"], callback, name=name, category="list_optimizers")


def on_before_reload(callback, *, name=None):
    add_callback(callback_map["callbacks_before_reload"], callback, name=name, category="before_reload")


def on_cfg_denoiser(callback, *, name=None):
    add_callback(callback_map["callbacks_cfg_denoiser"], callback, name=name, category="cfg_denoiser")
