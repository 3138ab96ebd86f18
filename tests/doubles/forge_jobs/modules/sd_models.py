"""Double of Forge's modules/sd_models.py (dfdcbab6): the checkpoints on disk and ``forge_model_reload``,
the one way Forge changes the model inside a job.

* ``CheckpointInfo(filename)`` is registered under its title and names (``checkpoints_list``,
  ``checkpoint_aliases``); ``get_closet_checkpoint_match`` and ``select_checkpoint``
  (``opts.sd_model_checkpoint``) find it. A checkpoint's file is one of ``backend.loader.files``.
* ``model_data`` holds the loaded model and the loading parameters that ``modules_forge.main_entry``
  sets; ``forge_model_reload()`` does nothing while those are the ones it loaded last, and otherwise drops
  the loaded model (``memory_management.unload_all_models()``), builds a new one from the file
  (``backend.loader.forge_loader``), stamps it, makes it the webui's (``shared.sd_model``, a property
  over ``model_data`` in Forge), runs the ``model_loaded`` callbacks and returns ``(model, True)``.
* ``SkipWritingToConfig()`` is a no-op context and ``reload_model_weights``/``load_model`` do nothing, as
  in Forge: a switch goes through ``main_entry.checkpoint_change`` and ``forge_model_reload``.
* Forge Neo (7862a964) also deletes the dropped model's ``forge_objects`` and ``model`` before it builds the
  next one (``NEO_DROPS``, set by the Neo overlay).
"""
import contextlib
import os

from modules import script_callbacks, shared
from modules.options import OptionInfo

# shared_options: "sd_model_checkpoint": OptionInfo(None, "(Managed by Forge)", gr.State, infotext="Model")
shared.opts.add_option("sd_model_checkpoint", OptionInfo(None, "(Managed by Forge)", None))

checkpoints_list = {}
checkpoint_aliases = {}
#: Attributes Forge Neo deletes from the model it drops (empty: Forge keeps the object whole).
NEO_DROPS = ()


class CheckpointInfo:
    def __init__(self, filename):
        self.filename = filename
        name = os.path.splitext(os.path.basename(filename))[0]
        self.name = self.name_for_extra = self.model_name = name
        self.title = self.short_title = name
        self.hash = self.sha256 = self.shorthash = None
        self.ids = [self.title, name, filename]

    def register(self):
        checkpoints_list[self.title] = self
        for alias in self.ids:
            checkpoint_aliases[alias] = self

    def calculate_shorthash(self):
        return self.shorthash

    def __repr__(self):
        return str(dict(filename=self.filename, hash=self.hash))


def get_closet_checkpoint_match(search_string):
    if not search_string:
        return None
    info = checkpoint_aliases.get(search_string)
    if info is not None:
        return info
    found = sorted([i for i in checkpoints_list.values() if search_string in i.title], key=lambda i: len(i.title))
    return found[0] if found else None


def select_checkpoint():
    info = checkpoint_aliases.get(shared.opts.sd_model_checkpoint)
    if info is not None:
        return info
    return next(iter(checkpoints_list.values()), None)


def SkipWritingToConfig():  # noqa: N802 - Forge's name
    return contextlib.nullcontext()


def reload_model_weights(sd_model=None, info=None, forced_reload=False):
    pass


def load_model(checkpoint_info=None, already_loaded_state_dict=None):
    pass


class FakeInitialModel:
    def __init__(self):
        self.cond_stage_model = None


class SdModelData:
    def __init__(self):
        self.sd_model = FakeInitialModel()
        self.forge_loading_parameters = {}
        self.forge_hash = ""

    def get_sd_model(self):
        return self.sd_model

    def set_sd_model(self, v):
        self.sd_model = v
        shared.sd_model = v


model_data = SdModelData()


def forge_model_reload():
    current_hash = str(model_data.forge_loading_parameters)
    if model_data.forge_hash == current_hash:
        return model_data.sd_model, False
    from backend import memory_management
    from backend.loader import forge_loader
    if model_data.sd_model:
        dropped = model_data.sd_model
        for junk in NEO_DROPS:
            if hasattr(dropped, junk):
                delattr(dropped, junk)
        model_data.sd_model = None
        memory_management.unload_all_models()
    checkpoint_info = model_data.forge_loading_parameters["checkpoint_info"]
    if checkpoint_info is None:
        raise ValueError("You do not have any model! Please download at least one model in [models/Stable-diffusion].")
    sd_model = forge_loader(checkpoint_info.filename, additional_state_dicts=model_data.forge_loading_parameters.get(
        "additional_modules", []))
    sd_model.extra_generation_params = {}
    sd_model.comments = []
    sd_model.sd_checkpoint_info = checkpoint_info
    sd_model.filename = checkpoint_info.filename
    sd_model.sd_model_hash = checkpoint_info.calculate_shorthash()
    model_data.set_sd_model(sd_model)
    script_callbacks.model_loaded_callback(sd_model)
    model_data.forge_hash = current_hash
    return sd_model, True
