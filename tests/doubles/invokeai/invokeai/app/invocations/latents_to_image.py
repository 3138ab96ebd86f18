"""Double of the ``l2i`` node of ``invokeai/app/invocations/latents_to_image.py`` (InvokeAI 6.14.2).

As the release: a ``WithMetadata``, ``WithBoard`` node with ``latents`` and ``vae`` (required connections),
``tiled``, ``tile_size``, ``fp32``; it loads the VAE, decodes ``latents / scaling_factor``, turns [-1, 1]
into an RGB image, saves it with ``context.images.save(image=image)`` (so the metadata that reaches the
image is the node's own ``metadata`` input) and returns ``ImageOutput.build(image_dto)``.
Not kept: tiled decoding, seamless axes, fp16 decoding.
"""
import torch
from PIL import Image

from invokeai.app.invocations.baseinvocation import BaseInvocation, invocation
from invokeai.app.invocations.fields import (
    FieldDescriptions,
    Input,
    InputField,
    LatentsField,
    WithBoard,
    WithMetadata,
)
from invokeai.app.invocations.model import VAEField
from invokeai.app.invocations.primitives import ImageOutput
from invokeai.app.services.shared.invocation_context import InvocationContext


@invocation("l2i", title="Latents to Image - SD1.5, SDXL", tags=["latents", "image", "vae", "l2i"],
            category="latents", version="1.3.2")
class LatentsToImageInvocation(BaseInvocation, WithMetadata, WithBoard):
    """Decodes latents into an image."""

    latents: LatentsField = InputField(description=FieldDescriptions.latents, input=Input.Connection)
    vae: VAEField = InputField(description=FieldDescriptions.vae, input=Input.Connection)
    tiled: bool = InputField(default=False, description=FieldDescriptions.tiled)
    tile_size: int = InputField(default=0, multiple_of=8, description="Tile size in pixels")
    fp32: bool = InputField(default=False, description=FieldDescriptions.fp32)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> ImageOutput:
        latents = context.tensors.load(self.latents.latents_name)
        with context.models.load(self.vae.vae) as vae:
            decoded = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        pixels = ((decoded[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        image = Image.fromarray(pixels, mode="RGB")
        image_dto = context.images.save(image=image)
        return ImageOutput.build(image_dto)
