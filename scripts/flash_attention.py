"""Entry script of sd-webui-flash-attention for A1111, Forge, Forge Neo, reForge and Forge Classic.

The webui imports every file in ``scripts/`` and wipes earlier callback registrations first, so all
registration happens here, at import. Everything else lives in ``webui_attn``.
"""
from modules import script_callbacks, scripts

from host_attn import voice
from webui_attn.routing import detect
from webui_attn.ui import panel

HOST = detect.detect()
voice.prefix_engine_log()

if HOST.adapter:
    detect.adapter(HOST).register(script_callbacks)
else:
    voice.log_once("no-host", f"{detect.UNRECOGNISED}: attention is left as the webui set it, and nothing is patched")


def _on_ui_settings():
    panel.on_ui_settings()


def _on_app_started(demo, app):
    panel.on_app_started(demo, app)


def _on_cfg_denoiser(params):
    panel.on_cfg_denoiser(params)


script_callbacks.on_ui_settings(_on_ui_settings)
script_callbacks.on_cfg_denoiser(_on_cfg_denoiser)
script_callbacks.on_app_started(_on_app_started)
script_callbacks.on_script_unloaded(voice.unprefix_engine_log)
panel.watch_generations()
script_callbacks.on_script_unloaded(panel.unwatch_generations)


class FlashAttentionScript(scripts.Script):
    """Always-visible script: its UI and generation hooks are ``webui_attn.ui.panel``'s."""

    def title(self):
        return panel.title()

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        return panel.ui(self, is_img2img)

    def before_process(self, p, *args):
        panel.before_process(p, *args)

    def process(self, p, *args):
        panel.process(p, *args)

    def before_process_batch(self, p, *args, **kwargs):
        panel.before_process_batch(p, kwargs.get("batch_number"))

    def postprocess(self, p, processed, *args):
        panel.postprocess(p, processed, *args)
