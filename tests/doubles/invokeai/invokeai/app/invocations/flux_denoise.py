"""Doubles of ``flux_text_encoder`` (``invokeai/app/invocations/flux_text_encoder.py``) and ``flux_denoise``
(``invokeai/app/invocations/flux_denoise.py`` with the built-in Euler loop of ``invokeai/backend/flux/denoise.py``),
InvokeAI 6.14.2, for txt2img with one prompt.

``flux_denoise`` runs the release's own FLUX.1 model class (``invokeai.backend.flux.model.Flux``, tiny) with
the release's ``get_noise``, ``get_schedule``, ``pack``, ``unpack`` and ``generate_img_ids``, and calls it as
the release's loop does (``timestep_index``, ``total_num_timesteps``, a ``RegionalPromptingExtension`` holding
the text conditioning, no ControlNet or IP-Adapter). The step callback as there: only after each step, with
``step=step_index + 1``, ``order=1``, ``total_steps=len(timesteps) - 1``, ``timestep=int(t_curr * 1000)`` and
the preview latents ``img - t_curr * pred``, unpacked to (C, H, W) by the node's callback before
``context.util.flux_step_callback(state)``. Output: the packed-then-unpacked latents as ``LatentsOutput``.
``flux_text_encoder`` takes the prompt only (the release also takes CLIP and T5 encoder fields).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import (
    FieldDescriptions,
    FluxConditioningField,
    Input,
    InputField,
    OutputField,
)
from invokeai.app.invocations.model import TransformerField
from invokeai.app.invocations.primitives import LatentsOutput
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.flux.extensions.regional_prompting_extension import RegionalPromptingExtension
from invokeai.backend.flux.sampling_utils import generate_img_ids, get_noise, get_schedule, pack, unpack
from invokeai.backend.model_manager.taxonomy import SubModelType
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState


@dataclass
class FluxPromptConditioning:
    """What the model reads from the release's regional text conditioning for one prompt without a mask."""

    t5_embeddings: torch.Tensor
    t5_txt_ids: torch.Tensor
    clip_embeddings: torch.Tensor


@invocation_output("flux_conditioning_output")
class FluxConditioningOutput(BaseInvocationOutput):
    conditioning: FluxConditioningField = OutputField(description=FieldDescriptions.positive_cond)


@invocation("flux_text_encoder", title="Prompt - FLUX", tags=["prompt", "conditioning", "flux"],
            category="conditioning", version="1.1.2")
class FluxTextEncoderInvocation(BaseInvocation):
    """Encodes a prompt for FLUX (the double's stand-in encoder of the FLUX main model)."""

    prompt: str = InputField(description="Text prompt to encode.")
    transformer: Optional[TransformerField] = InputField(default=None, input=Input.Connection,
                                                         description="The FLUX model whose encoder to use")

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> FluxConditioningOutput:
        key = self.transformer.transformer.key if self.transformer else "tiny-flux-key"
        with context.models.load(key, SubModelType.TextEncoder) as encoder:
            t5 = encoder(self.prompt)
            conditioning = FluxPromptConditioning(t5_embeddings=t5, t5_txt_ids=torch.zeros(1, t5.shape[1], 3),
                                                  clip_embeddings=encoder.pooled(self.prompt))
        return FluxConditioningOutput(conditioning=FluxConditioningField(
            conditioning_name=context.conditioning.save(conditioning)))


@invocation("flux_denoise", title="FLUX Denoise", tags=["image", "flux"], category="latents", version="4.6.0")
class FluxDenoiseInvocation(BaseInvocation):
    """Denoises FLUX latents."""

    transformer: TransformerField = InputField(description=FieldDescriptions.flux_model, input=Input.Connection,
                                               title="Transformer")
    positive_text_conditioning: FluxConditioningField = InputField(description=FieldDescriptions.positive_cond,
                                                                   input=Input.Connection)
    width: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.width)
    height: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.height)
    num_steps: int = InputField(default=4, description=FieldDescriptions.steps)
    guidance: float = InputField(default=4.0, description="Guidance strength (ignored by models without it)")
    seed: int = InputField(default=0, description=FieldDescriptions.seed)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        latents = self._run_diffusion(context).detach().to("cpu")
        return LatentsOutput.build(latents_name=context.tensors.save(tensor=latents), latents=latents, seed=None)

    def _run_diffusion(self, context: InvocationContext) -> torch.Tensor:
        noise = get_noise(num_samples=1, height=self.height, width=self.width, device=torch.device("cpu"),
                          dtype=torch.float32, seed=self.seed)
        b, _c, latent_h, latent_w = noise.shape
        timesteps = get_schedule(num_steps=self.num_steps, image_seq_len=(latent_h // 2) * (latent_w // 2))
        img_ids = generate_img_ids(h=latent_h, w=latent_w, batch_size=b, device=noise.device, dtype=noise.dtype)
        img = pack(noise)
        text = context.conditioning.load(self.positive_text_conditioning.conditioning_name)
        regional = RegionalPromptingExtension(regional_text_conditioning=text)
        step_callback = self._build_step_callback(context)
        total_steps = len(timesteps) - 1
        guidance_vec = torch.full((b,), self.guidance)
        with context.models.load(self.transformer.transformer) as model:
            for step_index, (t_curr, t_prev) in enumerate(zip(timesteps[:-1], timesteps[1:])):
                pred = model(img=img, img_ids=img_ids, txt=text.t5_embeddings, txt_ids=text.t5_txt_ids,
                             y=text.clip_embeddings, timesteps=torch.full((b,), t_curr), guidance=guidance_vec,
                             timestep_index=step_index, total_num_timesteps=total_steps,
                             controlnet_double_block_residuals=None, controlnet_single_block_residuals=None,
                             ip_adapter_extensions=[], regional_prompting_extension=regional)
                preview = img - t_curr * pred
                img = img + (t_prev - t_curr) * pred
                step_callback(PipelineIntermediateState(step=step_index + 1, order=1, total_steps=total_steps,
                                                        timestep=int(t_curr * 1000), latents=preview))
        return unpack(img.float(), self.height, self.width)

    def _build_step_callback(self, context: InvocationContext) -> Callable[[PipelineIntermediateState], None]:
        def step_callback(state: PipelineIntermediateState) -> None:
            state.latents = unpack(state.latents.float(), self.height, self.width).squeeze()
            context.util.flux_step_callback(state)

        return step_callback
