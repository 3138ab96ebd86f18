"""Doubles of ``ideogram4_text_encoder`` and ``ideogram4_denoise`` (``invokeai/app/invocations/
ideogram4_text_encoder.py``, ``ideogram4_denoise.py``), InvokeAI 6.14.2.

As the release: ``ideogram4_denoise`` takes its step count from ``steps`` or, when that is empty (the
default), from its sampler preset (the release's ``PRESETS``: 48, 20 or 12 steps), and runs the release's
own loop (``run_ideogram4_denoise``, with the release's schedule) on the release's ``Ideogram4Transformer``
pair (tiny): the conditional branch over text and image tokens, the unconditional one over image tokens,
each calling SDPA in its own module. It has no step callback: after each step the loop calls back with
the steps done and the node signals ``context.util.signal_progress("Running Ideogram 4 denoising",
step / total)`` (the release adds a preview image when it can make one). ``ideogram4_text_encoder`` takes
the prompt only (the release runs Qwen3-VL) and saves ``prompt_embeds`` (tokens, features) in an object
with ``conditionings[0].prompt_embeds`` as the release's does. Not kept: the guidance and ``mu`` overrides
(the preset's guidance schedule with the preset's steps, a constant 7.0 with ``steps`` set).
"""
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import FieldDescriptions, Ideogram4ConditioningField, Input, InputField, OutputField
from invokeai.app.invocations.model import TransformerField
from invokeai.app.invocations.primitives import LatentsOutput
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.ideogram4.denoise import run_ideogram4_denoise
from invokeai.backend.ideogram4.sampler_configs import PRESETS
from invokeai.backend.model_manager.taxonomy import SubModelType


@dataclass
class Ideogram4ConditioningInfo:
    prompt_embeds: torch.Tensor


@dataclass
class ConditioningFieldData:
    conditionings: list


@invocation_output("ideogram4_conditioning_output")
class Ideogram4ConditioningOutput(BaseInvocationOutput):
    conditioning: Ideogram4ConditioningField = OutputField(description=FieldDescriptions.positive_cond)


@invocation("ideogram4_text_encoder", title="Prompt - Ideogram 4", tags=["prompt", "conditioning", "ideogram4"],
            category="conditioning", version="1.0.0")
class Ideogram4TextEncoderInvocation(BaseInvocation):
    """Encodes a prompt for Ideogram 4 (the double's stand-in encoder)."""

    prompt: str = InputField(description="Text prompt to encode.")

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> Ideogram4ConditioningOutput:
        with context.models.load("tiny-ideogram4-key", SubModelType.TextEncoder) as encoder:
            embeds = encoder(self.prompt)[0]
        data = ConditioningFieldData(conditionings=[Ideogram4ConditioningInfo(prompt_embeds=embeds)])
        return Ideogram4ConditioningOutput(conditioning=Ideogram4ConditioningField(
            conditioning_name=context.conditioning.save(data)))


@invocation("ideogram4_denoise", title="Denoise - Ideogram 4", tags=["image", "ideogram4"], category="latents",
            version="1.0.0")
class Ideogram4DenoiseInvocation(BaseInvocation):
    """Runs the Ideogram 4 dual-branch flow-matching denoising loop."""

    transformer: TransformerField = InputField(description=FieldDescriptions.flux_model, input=Input.Connection,
                                               title="Transformer")
    positive_conditioning: Ideogram4ConditioningField = InputField(description=FieldDescriptions.positive_cond,
                                                                   input=Input.Connection)
    sampler_preset: Literal["V4_QUALITY_48", "V4_DEFAULT_20", "V4_TURBO_12"] = InputField(
        default="V4_QUALITY_48", description="Sampler preset")
    width: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.width)
    height: int = InputField(default=1024, multiple_of=16, description=FieldDescriptions.height)
    seed: int = InputField(default=0, description=FieldDescriptions.seed)
    steps: Optional[int] = InputField(default=None, ge=2, le=100, description="Override the preset's step count")

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        preset = PRESETS[self.sampler_preset]
        num_steps = self.steps if self.steps is not None else preset.num_steps
        guidance = preset.guidance_schedule if self.steps is None else None
        data = context.conditioning.load(self.positive_conditioning.conditioning_name)
        features = data.conditionings[0].prompt_embeds.float()

        def step_callback(step: int, total: int, packed_latents: torch.Tensor) -> None:
            context.util.signal_progress("Running Ideogram 4 denoising", step / total)

        with context.models.load(self.transformer.transformer).model_on_device() as (_, pair):
            packed = run_ideogram4_denoise(
                conditional_transformer=pair.conditional, unconditional_transformer=pair.unconditional,
                llm_features=features, height=self.height, width=self.width, num_steps=num_steps, mu=preset.mu,
                std=preset.std, guidance_schedule=guidance, guidance_scale=7.0, seed=self.seed,
                device=torch.device("cpu"), step_callback=step_callback)
        packed = packed.detach().to("cpu")
        return LatentsOutput.build(latents_name=context.tensors.save(tensor=packed), latents=packed, seed=None)
