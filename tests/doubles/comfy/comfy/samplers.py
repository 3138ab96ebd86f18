"""Double of the part of ComfyUI's comfy/samplers.py (and sampler_helpers.prepare_model_patcher) that
brings a patcher's options to the model: the sampler copies ``model_options``, merges the patcher's
wrappers into its transformer options, runs the ``OUTER_SAMPLE`` wrappers around the sampling, and each
step calls ``apply_model`` with those transformer options. The steps here are plain Euler steps."""
import torch

from comfy import patcher_extension


def prepare_model_patcher(model, model_options):
    patcher_extension.merge_nested_dicts(model_options["transformer_options"].setdefault("wrappers", {}), model.wrappers,
                                         copy_dict1=False)


def sample(model_patcher, noise, sigmas, context):
    """Denoise ``noise`` over ``sigmas`` with the patcher's model; returns the latent."""
    model_options = patcher_extension.copy_nested_dicts(model_patcher.model_options)
    prepare_model_patcher(model_patcher, model_options)

    def outer_sample(x):
        options = model_options["transformer_options"]
        for i in range(len(sigmas) - 1):
            with torch.no_grad():
                denoised = model_patcher.model.apply_model(x, sigmas[i].expand(x.shape[0]), c_crossattn=context,
                                                           transformer_options=options)
            x = x + (sigmas[i + 1] - sigmas[i]) * (x - denoised) / sigmas[i]
        return x

    executor = patcher_extension.WrapperExecutor.new_class_executor(
        outer_sample, None, patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.OUTER_SAMPLE, model_options,
                                                               is_model_options=True))
    return executor.execute(noise)
