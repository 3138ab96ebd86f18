"""Double of the parts of modules/api/api.py that reach an always-on script and the settings.

``init_default_script_args``: every script's UI defaults (its components' values) at its
``args_from:args_to``. ``init_script_args``: a request's ``alwayson_scripts`` over those defaults, each
script taking at most as many values as it has components, by index, whatever the type of ``args``
(a string is indexed by character). ``set_config``: ``opts.set(key, value, is_api=True)`` for each pair,
stored whatever the value. ``txt2img``: the defaults, the request's args, then ``process_images``; the
response's ``info`` is ``Processed.js()``.
"""
import json

from modules import processing, shared


class HTTPException(Exception):
    def __init__(self, status_code, detail):
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


def init_default_script_args(script_runner):
    last = max([1] + [script.args_to for script in script_runner.scripts if script.args_to is not None])
    args = [None] * last
    args[0] = 0
    for script in script_runner.scripts:
        if script.controls:
            args[script.args_from:script.args_to] = [control.value for control in script.controls]
    return args


def init_script_args(alwayson_scripts, default_args, script_runner):
    args = list(default_args)
    for name, payload in (alwayson_scripts or {}).items():
        script = next((s for s in script_runner.scripts if s.name == name.lower()), None)
        if script is None:
            raise HTTPException(422, f"always on script {name} not found")
        if "args" in payload:
            for index in range(min(script.args_to - script.args_from, len(payload["args"]))):
                args[script.args_from + index] = payload["args"][index]
    return args


def set_config(req: dict):
    for key, value in req.items():
        shared.opts.set(key, value, is_api=True)


def txt2img(script_runner, alwayson_scripts=None, sd_model=None, **kwargs):
    """One ``/sdapi/v1/txt2img`` request; returns ``(processed, info)`` where ``info`` is what the response carries."""
    args = init_script_args(alwayson_scripts, init_default_script_args(script_runner), script_runner)
    p = processing.StableDiffusionProcessingTxt2Img(sd_model=sd_model, **kwargs)
    p.is_api = True
    p.do_not_save_grid = True   # not save_images (the request's default)
    p.scripts = script_runner
    p.script_args = tuple(args)
    from modules import call_queue
    with call_queue.queue_lock:   # the webui's queue lock, shared with the UI's generations
        shared.state.begin(job="scripts_txt2img")
        try:
            processed = processing.process_images(p)
        finally:
            shared.state.end()
    return processed, json.loads(processed.js())
