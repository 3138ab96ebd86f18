"""Double of modules/processing.py: the parts extensions touch (A3 infotext rules), the batch loop's
stop on ``state.interrupted`` and txt2img's sampling with its hires fix pass (``is_hr_pass``)."""
import json

import torch

from modules import shared


class StableDiffusionProcessing:
    def __init__(self, sd_model=None, prompt="", width=512, height=512, batch_size=1, n_iter=1, steps=20,
                 seed=-1, cfg_scale=7.0, sampler_name="Euler a", script_args=None, override_settings=None,
                 refiner_checkpoint_info=None, refiner_switch_at=None):
        self.sd_model = sd_model
        self.prompt = prompt
        self.all_prompts = [prompt] * batch_size * n_iter
        self.width = width
        self.height = height
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.steps = steps
        self.seed = seed
        self.all_seeds = [seed] * batch_size * n_iter
        self.cfg_scale = cfg_scale
        self.sampler_name = sampler_name
        self.script_args = list(script_args or [])
        self.override_settings = dict(override_settings or {})
        self.extra_generation_params = {}
        self.comments = {}
        self.scripts = None
        self.is_api = False
        self.is_hr_pass = False
        self.refiner_checkpoint_info = refiner_checkpoint_info   # A1111 resolves p.refiner_checkpoint to it
        self.refiner_switch_at = refiner_switch_at
        self.iteration = 0

    def comment(self, text):
        self.comments[text] = 1


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    def __init__(self, enable_hr=False, hr_second_pass_steps=0, denoising_strength=0.75, **kwargs):
        super().__init__(**kwargs)
        self.enable_hr = enable_hr
        self.hr_second_pass_steps = hr_second_pass_steps
        self.denoising_strength = denoising_strength

    def sample(self, conditioning, unconditional_conditioning, x):
        """The first pass from the noise ``x``, then, with ``enable_hr``, the hires pass over its result
        (a new sampler: ``sample_img2img``), with ``is_hr_pass`` set while it runs."""
        from modules import sd_samplers_kdiffusion
        self.sampler = sd_samplers_kdiffusion.KDiffusionSampler()
        samples = self.sampler.sample(self, x, conditioning, unconditional_conditioning)
        if not self.enable_hr:
            return samples
        return self.sample_hr_pass(samples, conditioning, unconditional_conditioning)

    def sample_hr_pass(self, samples, conditioning, unconditional_conditioning):
        if shared.state.interrupted:
            return samples
        self.is_hr_pass = True
        from modules import sd_samplers_kdiffusion
        self.sampler = sd_samplers_kdiffusion.KDiffusionSampler()
        noise = torch.randn(samples.shape, generator=torch.Generator().manual_seed(self.seed + 1), dtype=samples.dtype)
        samples = self.sampler.sample_img2img(self, samples, noise, conditioning, unconditional_conditioning,
                                              steps=self.hr_second_pass_steps or self.steps)
        self.is_hr_pass = False
        return samples


class Processed:
    def __init__(self, p, images_list, seed=-1, info="", comments=""):
        self.images = images_list
        self.prompt = p.prompt
        self.seed = seed
        self.info = info
        self.comments = "".join(f"{comment}\n" for comment in p.comments) if comments == "" else comments
        self.width = p.width
        self.height = p.height
        self.extra_generation_params = p.extra_generation_params  # the same dict, as in A1111

    def js(self):
        """What the HTTP API returns as ``info``: a JSON dump that writes what it cannot serialise as null."""
        obj = {"prompt": self.prompt, "seed": self.seed, "width": self.width, "height": self.height,
               "extra_generation_params": self.extra_generation_params, "infotexts": [self.info]}
        return json.dumps(obj, default=lambda o: None)


def quote(text):
    if ',' not in str(text) and '\n' not in str(text) and ':' not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def create_infotext(p, all_prompts=None, all_seeds=None, all_subseeds=None, comments=None, iteration=0,
                    position_in_batch=0, use_main_prompt=False, index=None, all_negative_prompts=None):
    """Built-in keys, then ``extra_generation_params`` (str, None = omitted, per-image list, or callable
    ``f(**locals)``), values with ',' ':' or newlines JSON-quoted."""
    if index is None:
        index = position_in_batch + iteration * p.batch_size
    all_prompts = all_prompts or p.all_prompts
    generation_params = {
        "Steps": p.steps,
        "Sampler": p.sampler_name,
        "CFG scale": p.cfg_scale,
        "Seed": p.all_seeds[0] if use_main_prompt else p.all_seeds[index],
        "Size": f"{p.width}x{p.height}",
    }
    for key, value in p.extra_generation_params.items():
        if callable(value):
            value = value(**locals())
        elif isinstance(value, list):
            value = value[index] if index < len(value) else None
        generation_params[key] = value
    generation_params["Version"] = "v1.10.1"
    text = ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in generation_params.items() if v is not None)
    prompt_text = p.prompt if use_main_prompt else all_prompts[index]
    return f"{prompt_text}\n{text}".strip()


def process_images(p):
    """The order of one generation (process_images_inner): always-on scripts' ``process``, then per batch
    (``n_iter``) a stop when ``state.interrupted``, sampling and decoding (here: the callable
    ``p.sd_model(p)``, if any); each image's infotext, ``Processed`` (with ``p``'s comments), scripts'
    ``postprocess``."""
    if p.scripts is not None:
        p.scripts.process(p)
    for n in range(p.n_iter):
        p.iteration = n
        if shared.state.skipped:
            shared.state.skipped = False
        if shared.state.interrupted or shared.state.stopping_generation:
            break
        if callable(p.sd_model):
            p.sd_model(p)
    infotext = create_infotext(p, index=0)
    processed = Processed(p, [], seed=p.all_seeds[0], info=infotext)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed
