"""Double of Forge's modules/sd_samplers_cfg_denoiser.py (dfdcbab6): the A1111 double's denoiser, whose
``forward`` asks ``apply_refiner(self, x)`` first (Forge Neo: ``apply_refiner(self, x, sigma[0])``,
``refine``) and then takes the conditioning the refiner made (``sampler.sampler_extra_args``), and whose
``update_inner_model`` reads ``p.get_conds()`` into them."""
from tests.doubles.underneath import extend

extend(globals(), "sd_samplers_cfg_denoiser")   # CFGDenoiser, CFGDenoiserParams, state, torch, ...

_A1111CFGDenoiser = CFGDenoiser


class CFGDenoiser(_A1111CFGDenoiser):
    def refine(self, x, sigma):
        return sd_samplers_common.apply_refiner(self, x)

    def update_inner_model(self):
        self.model_wrap = None
        c, uc = self.p.get_conds()
        self.sampler.sampler_extra_args["cond"] = c
        self.sampler.sampler_extra_args["uncond"] = uc

    def forward(self, x, sigma, uncond, cond, cond_scale, s_min_uncond, image_cond):
        if state.interrupted or state.skipped:
            raise sd_samplers_common.InterruptedException
        if self.refine(x, sigma):
            cond = self.sampler.sampler_extra_args["cond"]
            uncond = self.sampler.sampler_extra_args["uncond"]
        x_in = torch.cat([x, x])
        sigma_in = torch.cat([sigma, sigma])
        image_cond_in = torch.cat([image_cond, image_cond])
        denoiser_params = CFGDenoiserParams(x_in, image_cond_in, sigma_in, state.sampling_step, state.sampling_steps,
                                            cond, uncond, self)
        cfg_denoiser_callback(denoiser_params)
        cond_in = torch.cat([denoiser_params.text_cond, denoiser_params.text_uncond])
        x_out = self.inner_model(denoiser_params.x, denoiser_params.sigma,
                                 cond={"c_crossattn": [cond_in], "c_concat": [image_cond_in]})
        n = x.shape[0]
        denoised = x_out[n:] + (x_out[:n] - x_out[n:]) * cond_scale
        self.sampler.last_latent = denoised
        self.step += 1
        return denoised
