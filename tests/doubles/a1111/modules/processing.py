"""Double of modules/processing.py: the parts extensions touch (A3 infotext rules)."""
import json


class StableDiffusionProcessing:
    def __init__(self, sd_model=None, prompt="", width=512, height=512, batch_size=1, n_iter=1, steps=20,
                 seed=-1, cfg_scale=7.0, sampler_name="Euler a", script_args=None, override_settings=None):
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

    def comment(self, text):
        self.comments[text] = 1


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    pass


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
    """The order of one generation: always-on scripts' ``process``, sampling and decoding (here: the
    callable ``p.sd_model(p)``, if any), each image's infotext, ``Processed``, scripts' ``postprocess``."""
    if p.scripts is not None:
        p.scripts.process(p)
    if callable(p.sd_model):
        p.sd_model(p)
    infotext = create_infotext(p, index=0)
    processed = Processed(p, [], seed=p.all_seeds[0], info=infotext)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed
