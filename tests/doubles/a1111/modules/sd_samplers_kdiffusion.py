"""Double of modules/sd_samplers_kdiffusion.py (A1111 1.10.1) with k-diffusion's Euler sampler: one
denoiser call per step, then the step callback (``callback_state``). ``sample_img2img`` (the hires
fix pass) starts a new run over the tail of the schedule: ``t_enc + 1`` steps."""
import torch

from modules import sd_samplers_cfg_denoiser, sd_samplers_common


def sample_euler(model, x, sigmas, extra_args=None, callback=None):
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **(extra_args or {}))
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def get_sigmas(steps, dtype, sigma_max=14.6, sigma_min=0.03):
    ramp = torch.linspace(0, 1, steps, dtype=dtype)
    sigmas = (sigma_max ** (1 / 7) + ramp * (sigma_min ** (1 / 7) - sigma_max ** (1 / 7))) ** 7   # Karras
    return torch.cat([sigmas, sigmas.new_zeros([1])])


class KDiffusionSampler(sd_samplers_common.Sampler):
    def __init__(self, funcname="sample_euler"):
        super().__init__(funcname)
        self.func = sample_euler
        self.model_wrap_cfg = sd_samplers_cfg_denoiser.CFGDenoiser(self)

    def _extra_args(self, p, x, conditioning, unconditional_conditioning):
        return {"cond": conditioning, "image_cond": x.new_zeros([x.shape[0], 1]), "uncond": unconditional_conditioning,
                "cond_scale": p.cfg_scale, "s_min_uncond": 0.0}

    def sample(self, p, x, conditioning, unconditional_conditioning, steps=None):
        steps = steps or p.steps
        sigmas = get_sigmas(steps, x.dtype)
        x = x * sigmas[0]
        self.initialize(p)
        self.sampler_extra_args = self._extra_args(p, x, conditioning, unconditional_conditioning)
        return self.launch_sampling(steps, lambda: self.func(self.model_wrap_cfg, x, sigmas=sigmas,
                                                             extra_args=self.sampler_extra_args,
                                                             callback=self.callback_state))

    def sample_img2img(self, p, x, noise, conditioning, unconditional_conditioning, steps=None):
        steps = steps or p.steps
        t_enc = int(min(p.denoising_strength, 0.999) * steps)
        sigma_sched = get_sigmas(steps, x.dtype)[steps - t_enc - 1:]
        xi = x + noise * sigma_sched[0]
        self.initialize(p)
        self.sampler_extra_args = self._extra_args(p, x, conditioning, unconditional_conditioning)
        return self.launch_sampling(t_enc + 1, lambda: self.func(self.model_wrap_cfg, xi, sigmas=sigma_sched,
                                                                 extra_args=self.sampler_extra_args,
                                                                 callback=self.callback_state))
