"""Double of modules/sd_samplers_cfg_denoiser.py (A1111 1.10.1): the CFG denoiser a sampler calls.

``forward`` stops on ``state.interrupted``, lets the refiner take over (``apply_refiner``), stacks the
prompt's and the negative prompt's rows, calls the ``cfg_denoiser`` callbacks with
``CFGDenoiserParams(x_in, image_cond_in, sigma_in, state.sampling_step, state.sampling_steps, tensor,
uncond, self)``, runs the model once on both rows and combines them; ``step`` counts its calls. Forge,
Forge Neo, reForge and Forge Classic build the same params, in the same order, before their own
model call (their ``sampling_function`` over ``forge_objects.unet``).
"""
import torch

from modules import sd_samplers_common, shared
from modules.script_callbacks import CFGDenoiserParams, cfg_denoiser_callback
from modules.shared import state


class CFGDenoiser(torch.nn.Module):
    def __init__(self, sampler):
        super().__init__()
        self.model_wrap = None
        self.steps = None
        self.total_steps = None
        self.step = 0
        self.sampler = sampler
        self.p = None

    @property
    def inner_model(self):
        if self.model_wrap is None:
            self.model_wrap = CompVisDenoiser(shared.sd_model)
        return self.model_wrap

    def update_inner_model(self):
        self.model_wrap = None

    def forward(self, x, sigma, uncond, cond, cond_scale, s_min_uncond, image_cond):
        if state.interrupted or state.skipped:
            raise sd_samplers_common.InterruptedException
        sd_samplers_common.apply_refiner(self, sigma)
        x_in = torch.cat([x, x])
        sigma_in = torch.cat([sigma, sigma])
        image_cond_in = torch.cat([image_cond, image_cond])
        denoiser_params = CFGDenoiserParams(x_in, image_cond_in, sigma_in, state.sampling_step, state.sampling_steps,
                                            cond, uncond, self)
        cfg_denoiser_callback(denoiser_params)
        x_in, sigma_in = denoiser_params.x, denoiser_params.sigma
        cond_in = torch.cat([denoiser_params.text_cond, denoiser_params.text_uncond])
        x_out = self.inner_model(x_in, sigma_in, cond={"c_crossattn": [cond_in], "c_concat": [image_cond_in]})
        n = x.shape[0]
        denoised = x_out[n:] + (x_out[:n] - x_out[n:]) * cond_scale
        self.sampler.last_latent = denoised
        self.step += 1
        return denoised


class CompVisDenoiser(torch.nn.Module):
    """k-diffusion's wrapper of an eps-prediction model: ``x - sigma * eps(x * c_in, sigma)``."""

    def __init__(self, model):
        super().__init__()
        self.inner_model = model

    def forward(self, x, sigma, cond):
        c_in = 1 / (sigma ** 2 + 1) ** 0.5
        eps = self.inner_model.apply_model(x * c_in.reshape(-1, *[1] * (x.dim() - 1)), sigma, cond)
        return x - eps * sigma.reshape(-1, *[1] * (x.dim() - 1))
