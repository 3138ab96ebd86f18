"""Double of the part of ComfyUI's comfy/samplers.py (and sampler_helpers.prepare_model_patcher) that
brings a patcher's options to the model, in ComfyUI's order:

* ``CFGGuider.sample`` copies ``model_options``, merges the patcher's wrappers into its transformer
  options and runs the ``OUTER_SAMPLE`` wrappers (their executor's ``class_obj`` is the guider, whose
  ``model_patcher`` is the patcher being sampled) around ``outer_sample(noise, latent_image, sampler,
  sigmas, ...)``;
* ``inner_sample`` puts the sampler's sigmas (the whole schedule, on the model's device) into a copy
  of the options as ``transformer_options["sample_sigmas"]``;
* each model call (``calc_cond_batch``) builds fresh transformer options from those, sets
  ``transformer_options["sigmas"]`` to the step's sigma tensor (one per batch entry) and calls
  ``apply_model``, which runs the ``APPLY_MODEL`` wrappers found in those transformer options.

The sampler is Euler as k-diffusion's ``sample_euler`` (the model is called at ``sigmas[i] * s_in``);
conditioning is one cross-attention context, without CFG. ``sample(patcher, noise, sigmas, context)``
is KSampler's work in one call."""
import torch

from comfy import patcher_extension


def prepare_model_patcher(model, conds, model_options):
    patcher_extension.merge_nested_dicts(model_options["transformer_options"].setdefault("wrappers", {}),
                                         model.wrappers, copy_dict1=False)


def calc_cond_batch(model, context, x_in, timestep, model_options):
    """One model call: fresh transformer options from the sampler's, with this step's sigmas."""
    transformer_options = patcher_extension.merge_nested_dicts({}, model_options["transformer_options"],
                                                               copy_dict1=False)
    transformer_options["sigmas"] = timestep
    return model.apply_model(x_in, timestep, c_crossattn=context, transformer_options=transformer_options)


def sample_euler(model, x, sigmas, extra_args):
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        sigma_hat = sigmas[i]
        denoised = model(x, sigma_hat * s_in, **extra_args)
        x = x + (sigmas[i + 1] - sigma_hat) * (x - denoised) / sigma_hat
    return x


class CFGGuider:
    def __init__(self, model_patcher):
        self.model_patcher = model_patcher
        self.model_options = model_patcher.model_options

    def predict(self, x, timestep, model_options, context):
        with torch.no_grad():
            return calc_cond_batch(self.inner_model, context, x, timestep, model_options)

    def inner_sample(self, noise, sigmas, context):
        extra_model_options = patcher_extension.copy_nested_dicts(self.model_options)
        extra_model_options.setdefault("transformer_options", {})["sample_sigmas"] = sigmas
        return sample_euler(self.predict, noise, sigmas, {"model_options": extra_model_options, "context": context})

    def outer_sample(self, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None, disable_pbar=False,
                     seed=None, latent_shapes=None):
        self.inner_model = self.model_patcher.model
        try:
            return self.inner_sample(noise, sigmas, self.context)
        finally:
            del self.inner_model

    def sample(self, noise, latent_image, sampler, sigmas, context):
        self.context = context
        orig_model_options = self.model_options
        self.model_options = patcher_extension.copy_nested_dicts(self.model_options)
        try:
            prepare_model_patcher(self.model_patcher, None, self.model_options)
            executor = patcher_extension.WrapperExecutor.new_class_executor(
                self.outer_sample, self,
                patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.OUTER_SAMPLE, self.model_options,
                                                   is_model_options=True))
            return executor.execute(noise, latent_image, sampler, sigmas, None, None, True, 0,
                                    latent_shapes=[latent_image.shape])
        finally:
            self.model_options = orig_model_options


def sample(model_patcher, noise, sigmas, context):
    """Denoise ``noise`` over ``sigmas`` with the patcher's model; returns the latent."""
    return CFGGuider(model_patcher).sample(noise, torch.zeros_like(noise), "euler", sigmas, context)
