"""Double of the outputs of ``invokeai/app/invocations/primitives.py`` (InvokeAI 6.14.2) that a txt2img graph
and a node pack use: ``StringOutput``, ``ImageOutput.build(image_dto)``, ``LatentsOutput.build(name, latents,
seed)`` (width and height are the latents' times 8), ``ConditioningOutput.build(name)``; and the String
Primitive node (``string``: its ``value`` out as ``StringOutput``), what a workflow connects to a text input."""
from typing import Optional

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import (
    ConditioningField,
    FieldDescriptions,
    ImageField,
    InputField,
    LatentsField,
    OutputField,
    QwenImageConditioningField,
)
from invokeai.app.services.shared.invocation_context import InvocationContext

LATENT_SCALE_FACTOR = 8


@invocation_output("string_output")
class StringOutput(BaseInvocationOutput):
    value: str = OutputField(description="The string")


@invocation("string", title="String Primitive", tags=["primitives", "string"], category="primitives", version="1.0.1")
class StringInvocation(BaseInvocation):
    """A text value, for a node's text input."""

    value: str = InputField(default="", description="The text")

    def invoke(self, context: InvocationContext) -> StringOutput:
        return StringOutput(value=self.value)


@invocation_output("image_output")
class ImageOutput(BaseInvocationOutput):
    image: ImageField = OutputField(description=FieldDescriptions.image)
    width: int = OutputField(description=FieldDescriptions.width)
    height: int = OutputField(description=FieldDescriptions.height)

    @classmethod
    def build(cls, image_dto) -> "ImageOutput":
        return cls(image=ImageField(image_name=image_dto.image_name), width=image_dto.width, height=image_dto.height)


@invocation_output("latents_output")
class LatentsOutput(BaseInvocationOutput):
    latents: LatentsField = OutputField(description=FieldDescriptions.latents)
    width: int = OutputField(description=FieldDescriptions.width)
    height: int = OutputField(description=FieldDescriptions.height)

    @classmethod
    def build(cls, latents_name: str, latents: torch.Tensor, seed: Optional[int] = None) -> "LatentsOutput":
        return cls(latents=LatentsField(latents_name=latents_name, seed=seed),
                   width=latents.size()[3] * LATENT_SCALE_FACTOR, height=latents.size()[2] * LATENT_SCALE_FACTOR)


@invocation_output("conditioning_output")
class ConditioningOutput(BaseInvocationOutput):
    conditioning: ConditioningField = OutputField(description=FieldDescriptions.positive_cond)

    @classmethod
    def build(cls, conditioning_name: str) -> "ConditioningOutput":
        return cls(conditioning=ConditioningField(conditioning_name=conditioning_name))


@invocation_output("qwen_image_conditioning_output")
class QwenImageConditioningOutput(BaseInvocationOutput):
    conditioning: QwenImageConditioningField = OutputField(description=FieldDescriptions.positive_cond)
