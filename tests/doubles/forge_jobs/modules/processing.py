"""Double of Forge's modules/processing.py (dfdcbab6): the A1111 double's infotext and ``Processed``, with
Forge's job path.

* ``process_images``: ``before_process``, the request's ``override_settings`` (a checkpoint it names that
  does not exist is dropped) through ``sysinfo.set_config`` without callbacks, the model
  (``manage_model_and_prompt_cache``: ``p.sd_model`` is what ``forge_model_reload()`` returns), the job,
  and the options put back through ``set_config`` with their onchange run.
* ``process_images_inner``: ``p.refiner_checkpoint`` resolved (an unknown one raises before any script
  runs), ``process``, ``p.init``; per batch: the stop on ``state.interrupted``, ``forge_model_reload()``
  (back to the selected checkpoint after a refiner; ``p.sd_model`` is not updated by it),
  ``before_process_batch``, ``process_batch``, the conditioning (``setup_conds``), ``params.txt`` from
  the first batch, sampling (``p.sample``) from the batch's seed, decoding with ``p.sd_model``
  (``decode_first_stage``), ``postprocess_batch``, each image's ``postprocess_image`` and infotext; the grid
  (not over the API), ``Processed``, ``postprocess``. The latents and decoded images are kept in
  ``p.latents_after_sampling`` / ``p.pixels_after_sampling``.
* txt2img's ``sample``: the first pass, then with ``enable_hr`` a hires checkpoint (``hr_checkpoint_name``)
  switched to through ``main_entry.checkpoint_change`` and ``forge_model_reload``, the selected checkpoint
  put back with the loading parameters (the model stays the hires one until the next reload), and the
  hires pass.
"""
import torch

from modules import shared
from tests.doubles.underneath import extend

extend(globals(), "processing")   # Processed, create_infotext, StableDiffusionProcessingTxt2Img, ...

_A1111Txt2Img = StableDiffusionProcessingTxt2Img

need_global_unload = False


def manage_model_and_prompt_cache(p):
    global need_global_unload
    from modules import sd_models
    p.sd_model, just_reloaded = sd_models.forge_model_reload()
    if need_global_unload and not just_reloaded:
        from backend import memory_management
        memory_management.unload_all_models()
    need_global_unload = False


def process_images(p):
    from modules import sd_models
    from modules.sysinfo import set_config
    if p.scripts is not None:
        p.scripts.before_process(p)
    opts = shared.opts
    stored_opts = {k: opts.data[k] if k in opts.data else opts.get_default(k) for k in p.override_settings.keys()
                   if k in opts.data}
    try:
        if sd_models.checkpoint_aliases.get(p.override_settings.get("sd_model_checkpoint")) is None:
            p.override_settings.pop("sd_model_checkpoint", None)
        set_config(p.override_settings, is_api=True, run_callbacks=False, save_config=False)
        manage_model_and_prompt_cache(p)
        res = process_images_inner(p)
    finally:
        if p.override_settings_restore_afterwards:
            set_config(stored_opts, save_config=False)
    return res


def decode_latent_batch(model, batch):
    return [model.decode_first_stage(batch[i:i + 1])[0] for i in range(batch.shape[0])]


def process_images_inner(p):
    from modules import devices, sd_models
    devices.torch_gc()
    if p.refiner_checkpoint not in (None, "", "None", "none"):
        p.refiner_checkpoint_info = sd_models.get_closet_checkpoint_match(p.refiner_checkpoint)
        if p.refiner_checkpoint_info is None:
            raise Exception(f"Could not find checkpoint with name {p.refiner_checkpoint}")
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
        sd_models.forge_model_reload()  # model can be changed for example by refiner, hiresfix
        p.prompts = p.all_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size]
        if p.scripts is not None:
            p.scripts.before_process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        if p.scripts is not None:
            p.scripts.process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        p.setup_conds()
        if n == 0:
            import os
            from modules import paths_internal
            with open(os.path.join(paths_internal.data_path, "params.txt"), "w", encoding="utf8") as file:
                file.write(Processed(p, []).infotext(p, 0))
        samples = p.sample(conditioning=p.c, unconditional_conditioning=p.uc, seeds=p.seeds)
        p.latents_after_sampling.extend(samples)
        decoded = decode_latent_batch(p.sd_model, samples)
        p.pixels_after_sampling.extend(decoded)
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


class StableDiffusionProcessingTxt2Img(_A1111Txt2Img):
    def __init__(self, refiner_checkpoint=None, hr_checkpoint_name=None, **kwargs):
        super().__init__(**kwargs)
        self.refiner_checkpoint = refiner_checkpoint
        self.hr_checkpoint_name = hr_checkpoint_name
        self.latents_after_sampling = []
        self.pixels_after_sampling = []

    def setup_conds(self):
        """The conditioning from the loaded model's text encoder (the refiner's after its switch)."""
        self.c = shared.sd_model.get_learned_conditioning(self.prompts)
        self.uc = shared.sd_model.get_learned_conditioning([""] * len(self.prompts))

    def get_conds(self):
        return self.c, self.uc

    def sample(self, conditioning, unconditional_conditioning, seeds=None, **kwargs):
        from modules import sd_models, sd_samplers_kdiffusion
        from modules_forge import main_entry
        x = torch.cat([shared.sd_model.noise(seed) for seed in seeds])
        self.sampler = sd_samplers_kdiffusion.KDiffusionSampler()
        samples = self.sampler.sample(self, x, conditioning, unconditional_conditioning)
        if not self.enable_hr:
            return samples
        fp_checkpoint = getattr(shared.opts, "sd_model_checkpoint")
        if self.hr_checkpoint_name and self.hr_checkpoint_name != "Use same checkpoint":
            if main_entry.checkpoint_change(self.hr_checkpoint_name, save=False, refresh=False):
                try:
                    main_entry.refresh_model_loading_parameters()
                    sd_models.forge_model_reload()
                finally:
                    main_entry.checkpoint_change(fp_checkpoint, save=False, refresh=False)
                    main_entry.refresh_model_loading_parameters()
        return self.sample_hr_pass(samples, conditioning, unconditional_conditioning)
