"""Double of ``invokeai/invocation_api/__init__.py`` (InvokeAI 6.14.2), the one module custom nodes are meant
to import. It re-exports, from the same modules as the release, those of the release's names that the
double provides; ``__all__`` lists exactly those. Importing it registers ``main_model_loader`` and
``core_metadata`` (their modules are imported here, as in the release)."""
from invokeai.app.invocations.baseinvocation import (
    BaseInvocation,
    BaseInvocationOutput,
    Bottleneck,
    Classification,
    invocation,
    invocation_output,
)
from invokeai.app.invocations.fields import (
    BoardField,
    ConditioningField,
    FieldDescriptions,
    FieldKind,
    FluxConditioningField,
    ImageField,
    Input,
    InputField,
    LatentsField,
    MetadataField,
    OutputField,
    UIComponent,
    UIType,
    WithBoard,
    WithMetadata,
)
from invokeai.app.invocations.metadata import MetadataOutput
from invokeai.app.invocations.model import (
    CLIPField,
    CLIPOutput,
    ControlLoRAField,
    LoRAField,
    ModelIdentifierField,
    ModelLoaderOutput,
    TransformerField,
    UNetField,
    UNetOutput,
    VAEField,
    VAEOutput,
)
from invokeai.app.invocations.primitives import ConditioningOutput, ImageOutput, LatentsOutput, StringOutput
from invokeai.app.services.image_records.image_records_common import ImageCategory
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.model_manager.load.load_base import LoadedModel
from invokeai.backend.model_manager.taxonomy import BaseModelType, ModelFormat, ModelType, SubModelType
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState
from invokeai.version import __version__

__all__ = [
    "BaseInvocation",
    "BaseInvocationOutput",
    "Bottleneck",
    "Classification",
    "invocation",
    "invocation_output",
    "InvocationContext",
    "BoardField",
    "ConditioningField",
    "FieldDescriptions",
    "FieldKind",
    "FluxConditioningField",
    "ImageField",
    "Input",
    "InputField",
    "LatentsField",
    "MetadataField",
    "OutputField",
    "UIComponent",
    "UIType",
    "WithBoard",
    "WithMetadata",
    "MetadataOutput",
    "ModelIdentifierField",
    "LoRAField",
    "UNetField",
    "CLIPField",
    "VAEField",
    "ControlLoRAField",
    "TransformerField",
    "UNetOutput",
    "VAEOutput",
    "CLIPOutput",
    "ModelLoaderOutput",
    "ConditioningOutput",
    "ImageOutput",
    "LatentsOutput",
    "StringOutput",
    "ImageCategory",
    "PipelineIntermediateState",
    "LoadedModel",
    "BaseModelType",
    "ModelFormat",
    "ModelType",
    "SubModelType",
    "__version__",
]
