"""Double of the ``compel`` node of ``invokeai/app/invocations/compel.py`` (InvokeAI 6.14.2): prompt and a
CLIP field (a required connection) -> ``ConditioningOutput``. It loads the text encoder named by the CLIP
field and saves its embedding of the prompt as the conditioning (the double's encoder is a stand-in, see
invokeai_tiny_models.py; the release runs CLIP through Compel)."""
import torch

from invokeai.app.invocations.baseinvocation import BaseInvocation, invocation
from invokeai.app.invocations.fields import FieldDescriptions, Input, InputField, UIComponent
from invokeai.app.invocations.model import CLIPField
from invokeai.app.invocations.primitives import ConditioningOutput
from invokeai.app.services.shared.invocation_context import InvocationContext


@invocation("compel", title="Prompt - SD1.5", tags=["prompt", "compel"], category="conditioning", version="1.2.1")
class CompelInvocation(BaseInvocation):
    """Encodes a prompt for SD1.5."""

    prompt: str = InputField(default="", description=FieldDescriptions.compel_prompt, ui_component=UIComponent.Textarea)
    clip: CLIPField = InputField(title="CLIP", description=FieldDescriptions.clip, input=Input.Connection)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> ConditioningOutput:
        with context.models.load(self.clip.text_encoder) as encoder:
            embeddings = encoder(self.prompt)
        return ConditioningOutput.build(context.conditioning.save(embeddings))
