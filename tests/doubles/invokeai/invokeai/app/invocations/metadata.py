"""Double of ``invokeai/app/invocations/metadata.py`` (InvokeAI 6.14.2): ``MetadataOutput`` and
``core_metadata``, whose output is every field given to it (extra fields allowed; None left out; ``id``,
``type``, ``is_intermediate``, ``use_cache`` left out) plus ``app_version``. A graph wires it to
``l2i.metadata``; without it the saved image has no metadata."""
from typing import Literal, Optional

from pydantic import ConfigDict

from invokeai.app.invocations.baseinvocation import (
    BaseInvocation,
    BaseInvocationOutput,
    Classification,
    invocation,
    invocation_output,
)
from invokeai.app.invocations.fields import InputField, MetadataField, OutputField
from invokeai.app.invocations.model import ModelIdentifierField
from invokeai.app.services.shared.invocation_context import InvocationContext

APP_VERSION = "6.14.2"


@invocation_output("metadata_output")
class MetadataOutput(BaseInvocationOutput):
    metadata: MetadataField = OutputField(description="The metadata")


@invocation("core_metadata", title="Core Metadata", tags=["metadata"], category="metadata", version="2.2.0",
            classification=Classification.Internal)
class CoreMetadataInvocation(BaseInvocation):
    """Collects a generation's parameters as metadata (a few of the release's fields are declared; any other
    given field is kept too, as the release allows extra fields)."""

    generation_mode: Optional[Literal["txt2img", "img2img", "inpaint", "outpaint", "flux_txt2img"]] = InputField(
        default=None, description="Generation mode")
    positive_prompt: Optional[str] = InputField(default=None, description="Positive prompt")
    negative_prompt: Optional[str] = InputField(default=None, description="Negative prompt")
    width: Optional[int] = InputField(default=None, description="Width")
    height: Optional[int] = InputField(default=None, description="Height")
    seed: Optional[int] = InputField(default=None, description="Seed")
    cfg_scale: Optional[float] = InputField(default=None, description="CFG scale")
    steps: Optional[int] = InputField(default=None, description="Steps")
    scheduler: Optional[str] = InputField(default=None, description="Scheduler")
    model: Optional[ModelIdentifierField] = InputField(default=None, description="Main model")

    def invoke(self, context: InvocationContext) -> MetadataOutput:
        as_dict = self.model_dump(exclude_none=True, exclude={"id", "type", "is_intermediate", "use_cache"})
        as_dict["app_version"] = APP_VERSION
        return MetadataOutput(metadata=MetadataField.model_validate(as_dict))

    model_config = ConfigDict(extra="allow")
