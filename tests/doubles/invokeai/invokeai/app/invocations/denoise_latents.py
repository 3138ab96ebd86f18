"""Double of the ``denoise_latents`` node of ``invokeai/app/invocations/denoise_latents.py`` and the loop of
``invokeai/backend/stable_diffusion/diffusers_pipeline.py`` (InvokeAI 6.14.2), for txt2img.

It loads the UNet and the scheduler named by its ``unet`` field, and runs classifier-free guidance (one UNet
call on the batch [negative, positive]) over the scheduler's timesteps. The step callback as the release's
pipeline calls it: once before the loop with the initial latents (step 0, the scheduler's ``order``,
``total_steps=len(timesteps)``, ``timestep=num_train_timesteps``), then after each step i with ``step=i+1``,
``timestep=int(t)``, the new latents and the scheduler's ``pred_original_sample``; each goes to
``context.util.sd_step_callback(state, base)`` with the UNet model's base. Before the loop the UNet's attention
is set up from the app config as the release's pipeline does it (``_adjust_memory_efficient_attention``):
``xformers`` only with xformers installed and a CUDA GPU of compute capability 7 or lower (else on to
``auto``), ``sliced`` the sliced processor (``attention_slice_size``: ``auto`` as the release detects it on
a CPU with the memory to spare, i.e. diffusers' "auto"), ``normal`` slicing off, ``torch-sdp`` the model as
it is, ``auto`` on a CPU slicing off (the release slices at "max" only when free memory is short). The
output latents are saved and returned as ``LatentsOutput`` (seed None, as the release). Not kept: img2img, masks, ControlNet, IP-Adapter,
LoRA, denoising_start/end other than 0 and 1, the scheduler list beyond euler and ddim.
"""
import importlib.util
from typing import Literal, Optional

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, invocation
from invokeai.app.invocations.fields import ConditioningField, FieldDescriptions, Input, InputField, LatentsField, UIType
from invokeai.app.invocations.model import UNetField
from invokeai.app.invocations.primitives import LatentsOutput
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState

SCHEDULER_NAME_VALUES = Literal["ddim", "euler"]


def _adjust_memory_efficient_attention(unet: torch.nn.Module, config: object) -> None:
    try:
        prefer_xformers = torch.cuda.is_available() and torch.cuda.get_device_properties("cuda").major <= 7
    except Exception:
        prefer_xformers = False
    attention_type = config.attention_type
    if attention_type == "xformers" and prefer_xformers and importlib.util.find_spec("xformers") is not None:
        unet.enable_xformers_memory_efficient_attention()
    elif attention_type == "sliced":
        size = config.attention_slice_size
        unet.set_attention_slice("auto" if size in ("auto", "balanced") else size)
    elif attention_type == "normal":
        unet.set_attention_slice(None)
    elif attention_type != "torch-sdp" and unet.device.type == "cpu":
        unet.set_attention_slice(None)


def _make_scheduler(loaded: object, name: str) -> object:
    """A fresh scheduler per run (it holds the timesteps), built from the model's scheduler config."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    cls = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}[name]
    return cls.from_config(loaded.config)


@invocation("denoise_latents", title="Denoise - SD1.5, SDXL",
            tags=["latents", "denoise", "txt2img", "t2i", "t2l", "img2img", "i2i", "l2l"], category="latents",
            version="1.6.0")
class DenoiseLatentsInvocation(BaseInvocation):
    """Denoises noise into latents an image can be decoded from."""

    positive_conditioning: ConditioningField = InputField(description=FieldDescriptions.positive_cond,
                                                          input=Input.Connection, ui_order=0)
    negative_conditioning: ConditioningField = InputField(description=FieldDescriptions.negative_cond,
                                                          input=Input.Connection, ui_order=1)
    noise: Optional[LatentsField] = InputField(default=None, description=FieldDescriptions.noise,
                                               input=Input.Connection, ui_order=3)
    steps: int = InputField(default=10, gt=0, description=FieldDescriptions.steps)
    cfg_scale: float = InputField(default=7.5, ge=1, description=FieldDescriptions.cfg_scale, title="CFG Scale")
    denoising_start: float = InputField(default=0.0, ge=0, le=1, description=FieldDescriptions.denoising_start)
    denoising_end: float = InputField(default=1.0, ge=0, le=1, description=FieldDescriptions.denoising_end)
    scheduler: SCHEDULER_NAME_VALUES = InputField(default="euler", description=FieldDescriptions.scheduler,
                                                  ui_type=UIType.Scheduler)
    unet: UNetField = InputField(description=FieldDescriptions.unet, input=Input.Connection, title="UNet", ui_order=2)
    latents: Optional[LatentsField] = InputField(default=None, description=FieldDescriptions.latents,
                                                 input=Input.Connection, ui_order=4)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        if self.noise is None:
            raise ValueError("The double's denoise_latents runs txt2img only: connect noise")
        unet_config = context.models.get_config(self.unet.unet.key)
        scheduler = _make_scheduler(context.models.load(self.unet.scheduler).model, self.scheduler)
        scheduler.set_timesteps(self.steps)
        timesteps = scheduler.timesteps
        positive = context.conditioning.load(self.positive_conditioning.conditioning_name)
        negative = context.conditioning.load(self.negative_conditioning.conditioning_name)
        text = torch.cat([negative, positive])
        latents = context.tensors.load(self.noise.latents_name) * scheduler.init_noise_sigma

        def step_callback(state: PipelineIntermediateState) -> None:
            context.util.sd_step_callback(state, unet_config.base)

        with context.models.load(self.unet.unet) as unet:
            _adjust_memory_efficient_attention(unet, context.config.get())
            step_callback(PipelineIntermediateState(step=0, order=scheduler.order, total_steps=len(timesteps),
                                                    timestep=scheduler.config.num_train_timesteps, latents=latents))
            for i, t in enumerate(timesteps):
                model_input = scheduler.scale_model_input(torch.cat([latents] * 2), t)
                uncond, cond = unet(model_input, t, encoder_hidden_states=text).sample.chunk(2)
                guided = uncond + self.cfg_scale * (cond - uncond)
                step_output = scheduler.step(guided, t, latents)
                latents = step_output.prev_sample
                step_callback(PipelineIntermediateState(
                    step=i + 1, order=scheduler.order, total_steps=len(timesteps), timestep=int(t), latents=latents,
                    predicted_original=getattr(step_output, "pred_original_sample", None)))
        latents = latents.detach().to("cpu")
        return LatentsOutput.build(latents_name=context.tensors.save(tensor=latents), latents=latents, seed=None)
