"""Double of modules/processing.py: the parts extensions touch (A3 infotext rules), ``process_images``
with a request's ``override_settings`` (set without callbacks, put back with ``setattr``), the batch loop
of ``process_images_inner`` in A1111 1.10.1's order (its stop on ``state.interrupted``, the script hooks
around each batch, ``params.txt`` written from the first batch before sampling, one infotext per image
written after its batch is decoded, the grid's from the main prompt), and txt2img's sampling with its
hires fix pass (``is_hr_pass``). The model switches A1111 makes are here too: back to the selected
checkpoint (``sd_models.reload_model_weights()``) before the generation and at the start of every batch
(after a refiner), and to the hires checkpoint before the hires pass."""
import json
import os

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
        self.override_settings_restore_afterwards = True
        self.do_not_save_grid = False
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

    def init(self, all_prompts, all_seeds, all_subseeds):
        """Called once after the scripts' ``process``, before the first batch (img2img encodes its
        init images here)."""


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    def __init__(self, enable_hr=False, hr_second_pass_steps=0, denoising_strength=0.75, hr_checkpoint_info=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.enable_hr = enable_hr
        self.hr_checkpoint_info = hr_checkpoint_info   # A1111 resolves p.hr_checkpoint_name to it
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
        from modules import sd_models
        with sd_models.SkipWritingToConfig():
            sd_models.reload_model_weights(info=self.hr_checkpoint_info)
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
    def __init__(self, p, images_list, seed=-1, info="", comments="", index_of_first_image=0, infotexts=None):
        self.images = images_list
        self.prompt = p.prompt
        self.seed = seed
        self.info = info
        self.comments = "".join(f"{comment}\n" for comment in p.comments) if comments == "" else comments
        self.width = p.width
        self.height = p.height
        self.batch_size = p.batch_size
        self.all_prompts = p.all_prompts
        self.all_seeds = p.all_seeds
        self.index_of_first_image = index_of_first_image
        self.infotexts = infotexts or [info]
        self.extra_generation_params = p.extra_generation_params  # the same dict, as in A1111

    def infotext(self, p, index):
        return create_infotext(p, self.all_prompts, self.all_seeds, None, comments=[],
                               position_in_batch=index % self.batch_size, iteration=index // self.batch_size)

    def js(self):
        """What the HTTP API returns as ``info``: a JSON dump that writes what it cannot serialise as null."""
        obj = {"prompt": self.prompt, "seed": self.seed, "width": self.width, "height": self.height,
               "extra_generation_params": self.extra_generation_params, "index_of_first_image":
               self.index_of_first_image, "infotexts": self.infotexts}
        return json.dumps(obj, default=lambda o: None)


def quote(text):
    if ',' not in str(text) and '\n' not in str(text) and ':' not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def create_infotext(p, all_prompts=None, all_seeds=None, all_subseeds=None, comments=None, iteration=0,
                    position_in_batch=0, use_main_prompt=False, index=None, all_negative_prompts=None):
    """Built-in keys, then ``extra_generation_params`` (str, None = omitted, per-image list, or callable
    called with this function's locals: ``p``, ``index``, ``use_main_prompt``, …; one that raises gives
    None), values with ',' ':' or newlines JSON-quoted."""
    if use_main_prompt:
        index = 0
    elif index is None:
        index = position_in_batch + iteration * p.batch_size
    all_prompts = all_prompts or p.all_prompts
    generation_params = {
        "Steps": p.steps,
        "Sampler": p.sampler_name,
        "CFG scale": p.cfg_scale,
        "Seed": p.all_seeds[0] if use_main_prompt else (all_seeds or p.all_seeds)[index],
        "Size": f"{p.width}x{p.height}",
        **p.extra_generation_params,
        "Version": "v1.10.1",
    }
    for key, value in generation_params.items():
        try:
            if isinstance(value, list):
                generation_params[key] = value[index]
            elif callable(value):
                generation_params[key] = value(**locals())
        except Exception:
            from modules import errors
            errors.report(f'Error creating infotext for key "{key}"', exc_info=True)
            generation_params[key] = None
    text = ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in generation_params.items() if v is not None)
    prompt_text = p.prompt if use_main_prompt else all_prompts[index]
    return f"{prompt_text}\n{text}".strip()


def process_images(p):
    """``before_process``, then the request's ``override_settings`` set with ``run_callbacks=False``, the
    generation, and the options put back with ``setattr`` (no onchange) unless
    ``override_settings_restore_afterwards`` is off."""
    if p.scripts is not None:
        p.scripts.before_process(p)
    opts = shared.opts
    stored_opts = {k: opts.data[k] if k in opts.data else opts.get_default(k) for k in p.override_settings.keys()
                   if k in opts.data}
    try:
        from modules import sd_models
        # no checkpoint override (or one not found): back to the selected checkpoint, after a refiner
        if sd_models.checkpoint_aliases.get(p.override_settings.get("sd_model_checkpoint")) is None:
            p.override_settings.pop("sd_model_checkpoint", None)
            sd_models.reload_model_weights()
        for k, v in p.override_settings.items():
            opts.set(k, v, is_api=True, run_callbacks=False)
            if k == "sd_model_checkpoint":
                sd_models.reload_model_weights()
        res = process_images_inner(p)
    finally:
        if p.override_settings_restore_afterwards:
            for k, v in stored_opts.items():
                setattr(opts, k, v)
    return res


def process_images_inner(p):
    """Always-on scripts' ``process``, ``p.init``; per batch (``n_iter``): a stop when ``state.interrupted``, the switch
    back to the selected checkpoint, ``before_process_batch``, ``process_batch``, ``params.txt`` (in ``paths_internal.data_path``) from the first batch, before sampling,
    sampling and decoding (here: the callable ``p.sd_model(p)``, if any), ``postprocess_batch``, then each
    image of the batch, ``postprocess_image`` then its infotext (``index`` in the batch, ``p.iteration`` the batch); the grid
    (more than one image, not over the API) with the main prompt's infotext first; ``Processed`` (with
    ``p``'s comments), scripts' ``postprocess``."""
    from modules import devices
    devices.torch_gc()
    if p.scripts is not None:
        p.scripts.process(p)
    p.init(p.all_prompts, p.all_seeds, None)
    infotexts = []
    output_images = []
    for n in range(p.n_iter):
        p.iteration = n
        if shared.state.skipped:
            shared.state.skipped = False
        if shared.state.interrupted or shared.state.stopping_generation:
            break
        from modules import sd_models
        sd_models.reload_model_weights()   # the refiner may have changed the model
        p.prompts = p.all_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size]
        if p.scripts is not None:
            p.scripts.before_process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        if p.scripts is not None:
            p.scripts.process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        if n == 0:
            from modules import paths_internal
            with open(os.path.join(paths_internal.data_path, "params.txt"), "w", encoding="utf8") as file:
                file.write(Processed(p, []).infotext(p, 0))
        if callable(p.sd_model):
            p.sd_model(p)
        images = [f"image {n}.{i}" for i in range(len(p.prompts))]
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, images, batch_number=n)

        def infotext(index=0, use_main_prompt=False):
            return create_infotext(p, p.prompts, p.seeds, None, use_main_prompt=use_main_prompt, index=index)

        for i, image in enumerate(images):
            p.batch_index = i
            if p.scripts is not None:
                from modules import scripts
                pp = scripts.PostprocessImageArgs(image)
                p.scripts.postprocess_image(p, pp)
                image = pp.image
            infotexts.append(infotext(i))
            output_images.append(image)
    if not infotexts:
        infotexts.append(Processed(p, []).infotext(p, 0))
    index_of_first_image = 0
    unwanted_grid = len(output_images) < 2 and shared.opts.grid_only_if_multiple
    if shared.opts.return_grid and not p.do_not_save_grid and not unwanted_grid:
        infotexts.insert(0, infotext(use_main_prompt=True))
        output_images.insert(0, "grid")
        index_of_first_image = 1
    processed = Processed(p, output_images, seed=p.all_seeds[0], info=infotexts[0],
                          index_of_first_image=index_of_first_image, infotexts=infotexts)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed
