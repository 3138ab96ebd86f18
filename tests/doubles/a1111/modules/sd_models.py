"""Double of modules/sd_models.py: the checkpoints a test has made stand for the files on disk;
``reload_model_weights(info=...)`` makes the one of that checkpoint ``shared.sd_model`` (as the refiner
switch does)."""
from modules import shared


class CheckpointInfo:
    def __init__(self, name):
        self.name = self.title = self.short_title = name


loaded = {}   # CheckpointInfo -> model (its sd_checkpoint_info is that info)


def reload_model_weights(sd_model=None, info=None):
    if info is None or shared.sd_model is not None and shared.sd_model.sd_checkpoint_info == info:
        return shared.sd_model
    shared.sd_model = loaded[info]
    return shared.sd_model
