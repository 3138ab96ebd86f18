"""Double of modules/sd_samplers_common.py (A1111 1.10.1): what a sampler does around the denoiser.

``Sampler.launch_sampling`` sets the denoiser's ``steps``/``total_steps`` and the webui's progress
(``state.sampling_steps``, ``state.sampling_step = 0``) before sampling; ``callback_state``, which the
k-diffusion sampler calls after each step, sets ``state.sampling_step`` to that step. ``apply_refiner``
switches to the refiner's checkpoint once the share of the denoiser's calls done reaches
``p.refiner_switch_at`` (A1111's rule when switching by sampling steps), without writing the refiner as the
selected checkpoint. Forge, Forge Neo, reForge and
Forge Classic have the same ``callback_state``/``launch_sampling``.
"""
from modules import sd_models, shared
from modules.shared import state


class InterruptedException(BaseException):
    pass


def apply_refiner(cfg_denoiser, sigma=None):
    completed_ratio = cfg_denoiser.step / cfg_denoiser.total_steps
    refiner_switch_at = cfg_denoiser.p.refiner_switch_at
    refiner_checkpoint_info = cfg_denoiser.p.refiner_checkpoint_info
    if refiner_switch_at is not None and completed_ratio < refiner_switch_at:
        return False
    if refiner_checkpoint_info is None or shared.sd_model.sd_checkpoint_info == refiner_checkpoint_info:
        return False
    cfg_denoiser.p.extra_generation_params["Refiner"] = refiner_checkpoint_info.short_title
    cfg_denoiser.p.extra_generation_params["Refiner switch at"] = refiner_switch_at
    with sd_models.SkipWritingToConfig():   # the selected checkpoint stays the base: the next batch goes back
        sd_models.reload_model_weights(info=refiner_checkpoint_info)
    cfg_denoiser.update_inner_model()
    return True


class Sampler:
    def __init__(self, funcname):
        self.funcname = funcname
        self.model_wrap_cfg = None
        self.sampler_extra_args = None
        self.last_latent = None
        self.stop_at = None
        self.p = None

    def callback_state(self, d):
        step = d["i"]
        if self.stop_at is not None and step > self.stop_at:
            raise InterruptedException
        state.sampling_step = step

    def launch_sampling(self, steps, func):
        self.model_wrap_cfg.steps = steps
        self.model_wrap_cfg.total_steps = steps   # config.total_steps(steps): one call per step for Euler
        state.sampling_steps = steps
        state.sampling_step = 0
        try:
            return func()
        except InterruptedException:
            return self.last_latent

    def initialize(self, p):
        self.p = p
        self.model_wrap_cfg.p = p
        self.model_wrap_cfg.step = 0
        return {}
