"""Double of Forge's modules/sd_samplers_common.py (dfdcbab6): the A1111 double's sampler, with Forge's
``apply_refiner(cfg_denoiser, x)``. Once the share of the denoiser's calls done reaches
``p.refiner_switch_at`` (and the refiner is not loaded): ``Refiner``/``Refiner switch at`` into the
infotext, the refiner made the selected checkpoint without refreshing (``main_entry.checkpoint_change``),
the loading parameters refreshed and the model reloaded (``forge_model_reload``), and in any case the
selected checkpoint put back with the loading parameters refreshed (so the next batch's reload goes back
to it); then the conditioning again from the refiner (``p.setup_conds``) and ``update_inner_model``.
(Forge's ``sampling_cleanup``/``sampling_prepare`` move weights and are left out.)"""
from tests.doubles.underneath import extend

extend(globals(), "sd_samplers_common")


def apply_refiner(cfg_denoiser, x):
    from modules_forge import main_entry
    completed_ratio = cfg_denoiser.step / cfg_denoiser.total_steps
    refiner_switch_at = cfg_denoiser.p.refiner_switch_at
    refiner_checkpoint_info = cfg_denoiser.p.refiner_checkpoint_info
    if refiner_switch_at is not None and completed_ratio < refiner_switch_at:
        return False
    if refiner_checkpoint_info is None or shared.sd_model.sd_checkpoint_info == refiner_checkpoint_info:
        return False
    cfg_denoiser.p.extra_generation_params["Refiner"] = refiner_checkpoint_info.short_title
    cfg_denoiser.p.extra_generation_params["Refiner switch at"] = refiner_switch_at
    with sd_models.SkipWritingToConfig():
        fp_checkpoint = getattr(shared.opts, "sd_model_checkpoint")
        checkpoint_changed = main_entry.checkpoint_change(refiner_checkpoint_info.short_title, save=False, refresh=False)
        if checkpoint_changed:
            try:
                main_entry.refresh_model_loading_parameters()
                sd_models.forge_model_reload()
            finally:
                main_entry.checkpoint_change(fp_checkpoint, save=False, refresh=True)
    cfg_denoiser.p.setup_conds()
    cfg_denoiser.update_inner_model()
    return True
