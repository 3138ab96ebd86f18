"""Double of ComfyUI's comfy/model_base.py: ``BaseModel`` holds the ``diffusion_model`` and
``apply_model`` hands it the transformer options the sampler built. Like the real one it imports every
model family's module, so they are all loaded (and hold their by-name copies) before custom nodes load."""
from torch import nn

import comfy.ldm.flux.model  # noqa: F401
import comfy.ldm.modules.diffusionmodules.openaimodel  # noqa: F401
import comfy.ldm.wan.model  # noqa: F401


class BaseModel(nn.Module):
    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model

    def apply_model(self, x, t, c_crossattn=None, transformer_options={}, **kwargs):
        return self.diffusion_model(x, timesteps=t, context=c_crossattn, transformer_options=transformer_options)
