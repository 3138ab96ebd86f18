"""Doubles of ``qwen_image_text_encoder`` (``invokeai/app/invocations/qwen_image_text_encoder.py``) and
``qwen_image_denoise`` (``invokeai/app/invocations/qwen_image_denoise.py``), InvokeAI 6.14.2, for txt2img.

``qwen_image_denoise`` runs diffusers' ``QwenImageTransformer2DModel`` (tiny; its attention processors call
diffusers' ``dispatch_attention_fn``) as the release does: packed 2x2 latents, ``img_shapes`` of the noisy
segment, ``timestep / 1000``, ``return_dict=False``, Euler steps ``latents + (sigma_next - sigma) * pred``
on the sigmas ``linspace(1, 1/steps, steps)`` and 0 (the release asks FlowMatchEulerDiscreteScheduler for
them, with a resolution shift), classifier-free guidance when a negative conditioning is connected and
cfg_scale is not 1. The step callback as there: step 0 with the initial latents before the loop
(``timestep`` the first scheduled timestep), then ``step=step_idx + 1`` with ``timestep=int(t)`` after each,
``order=1``, ``total_steps`` the number of scheduled steps, latents unpacked to 4D, each to
``context.util.sd_step_callback(state, BaseModelType.QwenImage)``. The output latents get a frame axis
(B, C, 1, H, W) as the release's do. ``qwen_image_text_encoder`` takes the prompt only.
"""
from typing import Optional

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, invocation
from invokeai.app.invocations.fields import FieldDescriptions, Input, InputField, QwenImageConditioningField
from invokeai.app.invocations.model import TransformerField
from invokeai.app.invocations.primitives import LatentsOutput, QwenImageConditioningOutput
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.model_manager.taxonomy import BaseModelType, SubModelType
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState

LATENT_CHANNELS = 4


def _pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _n, c = latents.shape
    return latents.view(b, h // 2, w // 2, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c // 4, h, w)


@invocation("qwen_image_text_encoder", title="Prompt - Qwen Image", tags=["prompt", "conditioning", "qwen_image"],
            category="conditioning", version="1.0.0")
class QwenImageTextEncoderInvocation(BaseInvocation):
    """Encodes a prompt for Qwen Image (the double's stand-in encoder)."""

    prompt: str = InputField(description="Text prompt to encode.")

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> QwenImageConditioningOutput:
        with context.models.load("tiny-qwen-image-key", SubModelType.TextEncoder) as encoder:
            embeddings = encoder(self.prompt)
        return QwenImageConditioningOutput(conditioning=QwenImageConditioningField(
            conditioning_name=context.conditioning.save(embeddings)))


@invocation("qwen_image_denoise", title="Denoise - Qwen Image", tags=["image", "qwen_image"], category="image",
            version="1.0.0")
class QwenImageDenoiseInvocation(BaseInvocation):
    """Denoises Qwen Image latents."""

    transformer: TransformerField = InputField(description=FieldDescriptions.qwen_image_model,
                                               input=Input.Connection, title="Transformer")
    positive_conditioning: QwenImageConditioningField = InputField(description=FieldDescriptions.positive_cond,
                                                                   input=Input.Connection)
    negative_conditioning: Optional[QwenImageConditioningField] = InputField(
        default=None, description=FieldDescriptions.negative_cond, input=Input.Connection)
    cfg_scale: float = InputField(default=4.0, description=FieldDescriptions.cfg_scale, title="CFG Scale")
    width: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.width)
    height: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.height)
    steps: int = InputField(default=40, gt=0, description=FieldDescriptions.steps)
    seed: int = InputField(default=0, description=FieldDescriptions.seed)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        latents = self._run_diffusion(context).detach().to("cpu")
        return LatentsOutput.build(latents_name=context.tensors.save(tensor=latents), latents=latents.squeeze(2),
                                   seed=None)

    def _run_diffusion(self, context: InvocationContext) -> torch.Tensor:
        h, w = self.height // 8, self.width // 8
        sigmas = torch.cat([torch.linspace(1.0, 1.0 / self.steps, self.steps), torch.zeros(1)])
        timesteps = sigmas[:-1] * 1000
        total_steps = len(timesteps)
        generator = torch.Generator("cpu").manual_seed(self.seed)
        latents = _pack(torch.randn(1, LATENT_CHANNELS, h, w, generator=generator))
        positive = context.conditioning.load(self.positive_conditioning.conditioning_name)
        negative = (context.conditioning.load(self.negative_conditioning.conditioning_name)
                    if self.negative_conditioning else None)
        img_shapes = [[(1, h // 2, w // 2)]]

        def step_callback(state: PipelineIntermediateState) -> None:
            context.util.sd_step_callback(state, BaseModelType.QwenImage)

        step_callback(PipelineIntermediateState(step=0, order=1, total_steps=total_steps,
                                                timestep=int(timesteps[0].item()), latents=_unpack(latents, h, w)))
        with context.models.load(self.transformer.transformer) as transformer:
            def predict(text: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return transformer(hidden_states=latents, encoder_hidden_states=text,
                                   encoder_hidden_states_mask=torch.ones(text.shape[:2]),
                                   timestep=t.expand(latents.shape[0]) / 1000, img_shapes=img_shapes,
                                   return_dict=False)[0]

            for step_idx, t in enumerate(timesteps):
                pred = predict(positive, t)
                if negative is not None and self.cfg_scale != 1.0:
                    uncond = predict(negative, t)
                    pred = uncond + self.cfg_scale * (pred - uncond)
                latents = latents + (sigmas[step_idx + 1] - sigmas[step_idx]) * pred
                step_callback(PipelineIntermediateState(step=step_idx + 1, order=1, total_steps=total_steps,
                                                        timestep=int(t.item()), latents=_unpack(latents, h, w)))
        return _unpack(latents, h, w).unsqueeze(2)
