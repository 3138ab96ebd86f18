"""Double of Forge's modules/sysinfo.py ``set_config`` (dfdcbab6), through which ``process_images`` applies
a request's ``override_settings`` (``run_callbacks=False``) and puts the options back after the job (with
their onchange run): a changed ``sd_model_checkpoint`` goes through ``main_entry.checkpoint_change`` (and
the loading parameters are refreshed once), every other option through ``opts.set``."""
from modules import shared


def set_config(req, is_api=False, run_callbacks=True, save_config=True):
    from modules import sd_models
    from modules_forge import main_entry
    should_refresh_model_loading_params = False
    for k, v in req.items():
        if v == shared.opts.data.get(k):
            continue
        if k == "sd_model_checkpoint":
            if v is not None and v not in sd_models.checkpoint_aliases:
                raise RuntimeError(f"model {v!r} not found")
            if main_entry.checkpoint_change(v, save=False, refresh=False):
                should_refresh_model_loading_params = True
        else:
            shared.opts.set(k, v, is_api=is_api, run_callbacks=run_callbacks)
    if should_refresh_model_loading_params:
        main_entry.refresh_model_loading_parameters()
