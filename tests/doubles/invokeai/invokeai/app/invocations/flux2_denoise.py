"""Doubles of ``flux_kontext`` (``invokeai/app/invocations/flux_kontext.py``) and ``flux2_denoise``
(``invokeai/app/invocations/flux2_denoise.py`` with ``invokeai/backend/flux2/denoise.py`` and the reference
image extension of ``invokeai/backend/flux2/ref_image_extension.py``), InvokeAI 6.14.2.

As the release: ``flux2_denoise`` loads its VAE (``vae``, a required connection) itself, reads the VAE's
batch-norm statistics, and, with reference images (``kontext_conditioning``, one or a list of
``flux_kontext`` outputs), encodes each image with that VAE inside the node (diffusers'
``AutoencoderKLFlux2.encode``, ``mode()`` of the distribution, in [-1, 1]), packs the latents with the
release's ``pack_flux2``, normalises them by the batch-norm statistics, gives them position ids with time
coordinate ``10 + 10 * index``, and appends them to the image tokens of every transformer call, dropping the
prediction for them. The transformer is diffusers' ``Flux2Transformer2DModel`` (tiny), called with
``hidden_states``, ``encoder_hidden_states``, ``timestep`` (0-1), ``img_ids``, ``txt_ids`` (4D),
``guidance``, ``return_dict=False``; Euler steps on the release's ``get_schedule_flux2`` sigmas; the step
callback only after each step (``step=step_index + 1``) to ``context.util.flux2_step_callback``.
Not kept: the scheduler choice and its dynamic shift, tiling of the reference encode (the release tiles at
512 px; these images are smaller), CFG, masks, regional prompts, img2img.
"""
from typing import Optional, Union

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import (
    FieldDescriptions,
    FluxConditioningField,
    FluxKontextConditioningField,
    ImageField,
    Input,
    InputField,
    OutputField,
)
from invokeai.app.invocations.model import TransformerField, VAEField
from invokeai.app.invocations.primitives import LatentsOutput
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.flux2.sampling_utils import generate_img_ids_flux2, get_schedule_flux2, pack_flux2, unpack_flux2
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState


#: The tiny FLUX.2 VAE's latent channels (the release's: 32); packed 2x2 they are the transformer's inputs.
LATENT_CHANNELS = 8


@invocation_output("flux_kontext_output")
class FluxKontextOutput(BaseInvocationOutput):
    kontext_cond: FluxKontextConditioningField = OutputField(description="A reference image",
                                                             title="Kontext Conditioning")


@invocation("flux_kontext", title="Kontext Conditioning - FLUX", tags=["conditioning", "kontext", "flux"],
            category="conditioning", version="1.0.0")
class FluxKontextInvocation(BaseInvocation):
    """Makes an image a reference image."""

    image: ImageField = InputField(description="The reference image")

    def invoke(self, context: InvocationContext) -> FluxKontextOutput:
        return FluxKontextOutput(kontext_cond=FluxKontextConditioningField(image=self.image))


def _reference_ids(h: int, w: int, index: int) -> torch.Tensor:
    ids = generate_img_ids_flux2(h, w, 1, torch.device("cpu"))
    ids[..., 0] = 10 + 10 * index
    return ids


@invocation("flux2_denoise", title="FLUX2 Denoise", tags=["image", "flux", "flux2", "klein", "denoise"],
            category="latents", version="1.6.0")
class Flux2DenoiseInvocation(BaseInvocation):
    """Denoises FLUX.2 latents, with reference images when given."""

    transformer: TransformerField = InputField(description=FieldDescriptions.flux_model, input=Input.Connection,
                                               title="Transformer")
    positive_text_conditioning: FluxConditioningField = InputField(description=FieldDescriptions.positive_cond,
                                                                   input=Input.Connection)
    width: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.width)
    height: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.height)
    num_steps: int = InputField(default=4, description=FieldDescriptions.steps)
    seed: int = InputField(default=0, description=FieldDescriptions.seed)
    vae: VAEField = InputField(description="The FLUX.2 VAE", input=Input.Connection)
    kontext_conditioning: Union[FluxKontextConditioningField, list[FluxKontextConditioningField], None] = InputField(
        default=None, description="Reference images", input=Input.Connection, title="Reference Images")

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        latents = self._run_diffusion(context).detach().to("cpu")
        return LatentsOutput.build(latents_name=context.tensors.save(tensor=latents), latents=latents, seed=None)

    def _bn_stats(self, context: InvocationContext) -> tuple[torch.Tensor, torch.Tensor]:
        with context.models.load(self.vae.vae).model_on_device() as (_, vae):
            bn = vae.bn
            return bn.running_mean.clone(), torch.sqrt(bn.running_var + bn.eps)

    def _references(self, context: InvocationContext, mean: torch.Tensor,
                    std: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        refs = self.kontext_conditioning
        if not refs:
            return None, None
        refs = refs if isinstance(refs, list) else [refs]
        loaded = context.models.load(self.vae.vae)
        latents, ids = [], []
        for index, ref in enumerate(refs):
            image = context.images.get_pil(ref.image.image_name).convert("RGB")
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).float()
            pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1).unsqueeze(0) / 255.0 * 2.0 - 1.0
            with loaded.model_on_device() as (_, vae):
                encoded = vae.encode(pixels, return_dict=False)[0].mode()
            _, _, h, w = encoded.shape
            latents.append((pack_flux2(encoded) - mean) / std)
            ids.append(_reference_ids(h, w, index))
        return torch.cat(latents, dim=1), torch.cat(ids, dim=1)

    def _run_diffusion(self, context: InvocationContext) -> torch.Tensor:
        mean, std = self._bn_stats(context)
        reference, reference_ids = self._references(context, mean, std)
        h, w = self.height // 16 * 2, self.width // 16 * 2  # the VAE's latents, before packing
        generator = torch.Generator("cpu").manual_seed(self.seed)
        img = pack_flux2(torch.randn(1, LATENT_CHANNELS, h, w, generator=generator))
        img_ids = generate_img_ids_flux2(h, w, 1, torch.device("cpu"))
        if reference is not None:
            model_img_ids = torch.cat([img_ids, reference_ids], dim=1)
        else:
            model_img_ids = img_ids
        text = context.conditioning.load(self.positive_text_conditioning.conditioning_name).t5_embeddings
        txt_ids = torch.zeros(1, text.shape[1], 4, dtype=torch.long)
        txt_ids[..., 3] = torch.arange(text.shape[1])
        timesteps = get_schedule_flux2(self.num_steps, img.shape[1]) + [0.0]
        total_steps = len(timesteps) - 1
        with context.models.load(self.transformer.transformer) as model:
            for step_index, (t_curr, t_prev) in enumerate(zip(timesteps[:-1], timesteps[1:])):
                img_input = torch.cat([img, reference], dim=1) if reference is not None else img
                pred = model(hidden_states=img_input, encoder_hidden_states=text,
                             timestep=torch.full((1,), t_curr), img_ids=model_img_ids, txt_ids=txt_ids,
                             guidance=None, return_dict=False)[0][:, :img.shape[1]]
                preview = img - t_curr * pred
                img = img + (t_prev - t_curr) * pred
                context.util.flux2_step_callback(PipelineIntermediateState(
                    step=step_index + 1, order=1, total_steps=total_steps, timestep=int(t_curr * 1000),
                    latents=unpack_flux2(preview, self.height, self.width)))
        return unpack_flux2(img * std + mean, self.height, self.width)
