"""Double of modules/sd_models.py (A1111 1.10.1): the checkpoints a test has made stand for the files on disk
(``loaded``: CheckpointInfo -> model), and how A1111 switches between them.

``reload_model_weights(info=None)`` loads ``info``, or the checkpoint ``opts.sd_model_checkpoint`` names
(``select_checkpoint``), unless it is the one loaded. A switch (the refiner's, a hires checkpoint's, the
switch back that ``process_images`` and each batch start make) goes A1111's way with the default of one
checkpoint kept in memory: ``undo_hijack`` of the model (which resets the attention forwards), the weights,
then ``hijack`` (which re-applies the cross attention optimization), the ``model_loaded`` callbacks, and
``sd_model_checkpoint`` written unless inside ``SkipWritingToConfig`` (the refiner and hires switches).
``load_model`` is the first load. A test's model stands for the loaded checkpoint until one is loaded this
way (A1111 always has the loaded one's title in ``sd_model_checkpoint``).
"""
from modules import script_callbacks, shared


class CheckpointInfo:
    def __init__(self, name):
        self.name = self.title = self.short_title = self.name_for_extra = name
        self.filename = f"{name}.safetensors"


loaded = {}   # CheckpointInfo -> model (its sd_checkpoint_info is that info)


class SkipWritingToConfig:
    skip = False
    previous = None

    def __enter__(self):
        self.previous = SkipWritingToConfig.skip
        SkipWritingToConfig.skip = True
        return self

    def __exit__(self, exc_type, exc_value, exc_traceback):
        SkipWritingToConfig.skip = self.previous


class _Aliases:
    """``checkpoint_aliases``: a checkpoint's title (or name) -> its CheckpointInfo, over ``loaded``."""

    def get(self, name, default=None):
        return next((info for info in loaded if name in (info.title, info.name)), default)


checkpoint_aliases = _Aliases()


def select_checkpoint():
    info = checkpoint_aliases.get(shared.opts.data.get("sd_model_checkpoint"))
    return info if info is not None else getattr(shared.sd_model, "sd_checkpoint_info", None)


def _hijack(model, info):
    from modules import sd_hijack
    sd_hijack.model_hijack.hijack(model)
    script_callbacks.model_loaded_callback(model)
    if not SkipWritingToConfig.skip:
        shared.opts.data["sd_model_checkpoint"] = info.title
    shared.sd_model = model
    return model


def load_model(checkpoint_info=None):
    info = checkpoint_info or select_checkpoint()
    return _hijack(loaded[info], info)


def reload_model_weights(sd_model=None, info=None, forced_reload=False):
    checkpoint_info = info or select_checkpoint()
    sd_model = sd_model or shared.sd_model
    if checkpoint_info is None:
        return sd_model
    if sd_model is not None and sd_model.sd_checkpoint_info == checkpoint_info and not forced_reload:
        return sd_model
    if sd_model is not None:
        from modules import sd_hijack
        sd_hijack.model_hijack.undo_hijack(sd_model)
    return _hijack(loaded[checkpoint_info], checkpoint_info)
