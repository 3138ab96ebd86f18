"""Double of the ``noise`` node of ``invokeai/app/invocations/noise.py`` (InvokeAI 6.14.2): seed, width,
height, use_cpu -> ``NoiseOutput`` (the latents' name, width, height; 4 channels at 1/8 of the size).
The values come from ``torch.randn`` with the seed (the release has its own generator)."""
import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import FieldDescriptions, InputField, LatentsField, OutputField
from invokeai.app.invocations.primitives import LATENT_SCALE_FACTOR
from invokeai.app.services.shared.invocation_context import InvocationContext


@invocation_output("noise_output")
class NoiseOutput(BaseInvocationOutput):
    noise: LatentsField = OutputField(description=FieldDescriptions.noise)
    width: int = OutputField(description=FieldDescriptions.width)
    height: int = OutputField(description=FieldDescriptions.height)


@invocation("noise", title="Create Latent Noise", tags=["latents", "noise"], category="latents", version="1.0.3")
class NoiseInvocation(BaseInvocation):
    """Makes SD latent noise."""

    seed: int = InputField(default=0, ge=0, description=FieldDescriptions.seed)
    width: int = InputField(default=512, multiple_of=LATENT_SCALE_FACTOR, gt=0, description=FieldDescriptions.width)
    height: int = InputField(default=512, multiple_of=LATENT_SCALE_FACTOR, gt=0, description=FieldDescriptions.height)
    use_cpu: bool = InputField(default=True, description="Make the noise on the CPU")

    def invoke(self, context: InvocationContext) -> NoiseOutput:
        generator = torch.Generator("cpu").manual_seed(self.seed)
        noise = torch.randn((1, 4, self.height // LATENT_SCALE_FACTOR, self.width // LATENT_SCALE_FACTOR),
                            generator=generator)
        name = context.tensors.save(tensor=noise)
        return NoiseOutput(noise=LatentsField(latents_name=name, seed=self.seed),
                           width=noise.shape[3] * LATENT_SCALE_FACTOR, height=noise.shape[2] * LATENT_SCALE_FACTOR)
