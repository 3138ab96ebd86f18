"""Double of Forge's modules_forge/main_entry.py (dfdcbab6), the checkpoint part: ``checkpoint_change``
writes the selected checkpoint (``opts.set``, its onchange run) and, with ``refresh``, the loading
parameters; ``refresh_model_loading_parameters`` sets them from ``select_checkpoint()`` and asks the next
job to unload (``processing.need_global_unload``). The model itself changes at the next
``sd_models.forge_model_reload()``. Forge Neo's take a ``preset`` too (unused here)."""
from modules import sd_models, shared


def refresh_model_loading_parameters():
    from modules import processing
    checkpoint_info = sd_models.select_checkpoint()
    sd_models.model_data.forge_loading_parameters = dict(
        checkpoint_info=checkpoint_info,
        additional_modules=shared.opts.data.get("forge_additional_modules", []),
        unet_storage_dtype=None,
    )
    processing.need_global_unload = True


def checkpoint_change(ckpt_name, preset=None, save=True, refresh=True):
    """Returns True if the checkpoint changed."""
    new_ckpt_info = sd_models.get_closet_checkpoint_match(ckpt_name)
    current_ckpt_info = sd_models.get_closet_checkpoint_match(shared.opts.data.get("sd_model_checkpoint", ""))
    if new_ckpt_info == current_ckpt_info:
        return False
    shared.opts.set("sd_model_checkpoint", ckpt_name)
    if refresh:
        refresh_model_loading_parameters()
    return True
