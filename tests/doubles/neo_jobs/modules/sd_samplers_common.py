"""Double of Forge Neo's modules/sd_samplers_common.py (7862a964): Forge's, but ``apply_refiner(cfg_denoiser,
x, sigma)`` switches once ``sigma`` is at or below ``p.refiner_switch_at`` (a sigma, not a share of the
steps), refuses a hires fix, returns False when the refiner is already the selected checkpoint, and drops
the denoiser's model before the reload."""
from tests.doubles.underneath import extend

extend(globals(), "sd_samplers_common", root="forge_jobs")


def apply_refiner(cfg_denoiser, x, sigma):
    from modules_forge import main_entry
    refiner_switch_at = cfg_denoiser.p.refiner_switch_at
    if refiner_switch_at is None or float(sigma) > refiner_switch_at:
        return False
    refiner_checkpoint_info = cfg_denoiser.p.refiner_checkpoint_info
    if refiner_checkpoint_info is None or shared.sd_model.sd_checkpoint_info == refiner_checkpoint_info:
        return False
    if getattr(cfg_denoiser.p, "enable_hr", False):
        print("\n\n[Error]Refiner does not support Hires. fix\n\n")
        return False
    cfg_denoiser.p.extra_generation_params["Refiner"] = refiner_checkpoint_info.short_title
    cfg_denoiser.p.extra_generation_params["Refiner switch at"] = refiner_switch_at
    original_checkpoint = getattr(shared.opts, "sd_model_checkpoint")
    if not main_entry.checkpoint_change(refiner_checkpoint_info.short_title, preset=None, save=False, refresh=False):
        return False
    del cfg_denoiser.model_wrap
    try:
        main_entry.refresh_model_loading_parameters()
        sd_models.forge_model_reload()
    finally:
        main_entry.checkpoint_change(original_checkpoint, preset=None, save=False, refresh=True)
    cfg_denoiser.p.setup_conds()
    cfg_denoiser.update_inner_model()
    return True
