"""Double of ComfyUI's comfy/model_base.py: ``BaseModel`` holds the ``diffusion_model`` and
``apply_model`` runs the ``APPLY_MODEL`` wrappers found in the transformer options the sampler built,
then hands them to the diffusion model. Like the real one it imports every
model family's module, so they are all loaded (and hold their by-name copies) before custom nodes load."""
from torch import nn

import comfy.cldm.cldm  # noqa: F401
import comfy.ldm.ace.ace_step15  # noqa: F401
import comfy.ldm.ernie.model  # noqa: F401
import comfy.ldm.flux.model  # noqa: F401
import comfy.ldm.hunyuan3dv2_1.hunyuandit  # noqa: F401
import comfy.ldm.hydit.models  # noqa: F401
import comfy.ldm.lightricks.model  # noqa: F401
import comfy.ldm.modules.diffusionmodules.openaimodel  # noqa: F401
import comfy.ldm.pixart.pixartms  # noqa: F401
import comfy.ldm.wan.model  # noqa: F401
import comfy.ldm.wan.model_animate  # noqa: F401
import comfy.ldm.wan.model_multitalk  # noqa: F401
import comfy.patcher_extension


class BaseModel(nn.Module):
    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._apply_model, self,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL,
                                                     transformer_options)
        ).execute(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def _apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        return self.diffusion_model(x, timesteps=t, context=c_crossattn, transformer_options=transformer_options)
