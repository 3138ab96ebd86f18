"""Double of ``invokeai/app/invocations/model.py`` (InvokeAI 6.14.2): model identifiers and the fields that
carry a model (with the release's attributes and defaults), their outputs, and ``main_model_loader``.

``main_model_loader`` as the release: fails with "Unknown model KEY" when the key is not installed, else
hands out copies of its identifier with ``submodel_type`` unet / scheduler / tokenizer / text_encoder / vae.
"""
from typing import List, Optional

from pydantic import BaseModel, Field

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, invocation, invocation_output
from invokeai.app.invocations.fields import FieldDescriptions, ImageField, InputField, OutputField
from invokeai.app.services.shared.invocation_context import InvocationContext
from invokeai.backend.model_manager.taxonomy import BaseModelType, ModelType, SubModelType


class ModelIdentifierField(BaseModel):
    key: str = Field(description="Key of the installed model")
    hash: str = Field(description="Hash of the model's files")
    name: str = Field(description="Name of the model")
    base: BaseModelType = Field(description="Base architecture")
    type: ModelType = Field(description="Kind of model")
    submodel_type: SubModelType | None = Field(default=None, description="Part of a main model to load")


class LoRAField(BaseModel):
    lora: ModelIdentifierField = Field(description="The LoRA")
    weight: float = Field(description="Its weight")


class FreeUConfig(BaseModel):
    """``invokeai/app/shared/models.py``: FreeU's four factors."""

    s1: float
    s2: float
    b1: float
    b2: float


class UNetField(BaseModel):
    unet: ModelIdentifierField = Field(description="The UNet submodel")
    scheduler: ModelIdentifierField = Field(description="The scheduler submodel")
    loras: List[LoRAField] = Field(description="LoRAs applied when the UNet loads")
    seamless_axes: List[str] = Field(default_factory=list, description="Axes made seamless")
    freeu_config: Optional[FreeUConfig] = Field(default=None, description="FreeU settings")


class CLIPField(BaseModel):
    tokenizer: ModelIdentifierField = Field(description="The tokenizer submodel")
    text_encoder: ModelIdentifierField = Field(description="The text encoder submodel")
    skipped_layers: int = Field(description="Text encoder layers skipped")
    loras: List[LoRAField] = Field(description="LoRAs applied when the encoder loads")


class VAEField(BaseModel):
    vae: ModelIdentifierField = Field(description="The VAE submodel")
    seamless_axes: List[str] = Field(default_factory=list, description="Axes made seamless")


class TransformerField(BaseModel):
    transformer: ModelIdentifierField = Field(description="The transformer submodel")
    loras: List[LoRAField] = Field(description="LoRAs applied when the transformer loads")


class WanTransformerField(BaseModel):
    transformer: ModelIdentifierField = Field(description="The transformer (the high-noise expert of A14B)")
    transformer_low_noise: ModelIdentifierField | None = Field(default=None, description="A14B's low-noise expert")
    loras: List[LoRAField] = Field(default_factory=list, description="LoRAs of the first transformer")
    loras_low_noise: List[LoRAField] = Field(default_factory=list, description="LoRAs of the low-noise expert")
    boundary_ratio: float = Field(default=0.875, ge=0.0, le=1.0, description="Where the experts switch")


class ControlLoRAField(LoRAField):
    img: ImageField = Field(description="Structural conditioning image")


@invocation_output("unet_output")
class UNetOutput(BaseInvocationOutput):
    unet: UNetField = OutputField(description=FieldDescriptions.unet, title="UNet")


@invocation_output("vae_output")
class VAEOutput(BaseInvocationOutput):
    vae: VAEField = OutputField(description=FieldDescriptions.vae, title="VAE")


@invocation_output("clip_output")
class CLIPOutput(BaseInvocationOutput):
    clip: CLIPField = OutputField(description=FieldDescriptions.clip, title="CLIP")


@invocation_output("model_loader_output")
class ModelLoaderOutput(UNetOutput, CLIPOutput, VAEOutput):
    pass


@invocation("main_model_loader", title="Main Model - SD1.5, SD2", tags=["model"], category="model", version="1.0.4")
class MainModelLoaderInvocation(BaseInvocation):
    """Hands out the submodels of an SD1.5/SD2 main model."""

    model: ModelIdentifierField = InputField(
        description=FieldDescriptions.main_model,
        ui_model_base=[BaseModelType.StableDiffusion1, BaseModelType.StableDiffusion2],
        ui_model_type=ModelType.Main,
    )

    def invoke(self, context: InvocationContext) -> ModelLoaderOutput:
        if not context.models.exists(self.model.key):
            raise Exception(f"Unknown model {self.model.key}")

        def part(sub: SubModelType) -> ModelIdentifierField:
            return self.model.model_copy(update={"submodel_type": sub})

        return ModelLoaderOutput(
            unet=UNetField(unet=part(SubModelType.UNet), scheduler=part(SubModelType.Scheduler), loras=[]),
            clip=CLIPField(tokenizer=part(SubModelType.Tokenizer), text_encoder=part(SubModelType.TextEncoder),
                           loras=[], skipped_layers=0),
            vae=VAEField(vae=part(SubModelType.VAE)),
        )


@invocation_output("transformer_loader_output")
class TransformerLoaderOutput(BaseInvocationOutput):
    """Output of this double's transformer loader (the release has one loader per family, e.g.
    ``flux_model_loader``, ``qwen_image_model_loader``, each with more outputs than the transformer)."""

    transformer: TransformerField = OutputField(description=FieldDescriptions.transformer, title="Transformer")
    vae: VAEField = OutputField(description=FieldDescriptions.vae, title="VAE")


@invocation("transformer_model_loader", title="Transformer model (double)", tags=["model"], category="model",
            version="1.0.0")
class TransformerModelLoaderInvocation(BaseInvocation):
    """Hands out the transformer and VAE of a DiT main model (FLUX, Qwen Image): this double's stand-in for the
    release's per-family loaders, which give the same ``TransformerField`` (``submodel_type`` transformer)."""

    model: ModelIdentifierField = InputField(description=FieldDescriptions.flux_model)

    def invoke(self, context: InvocationContext) -> TransformerLoaderOutput:
        if not context.models.exists(self.model.key):
            raise Exception(f"Unknown model {self.model.key}")
        return TransformerLoaderOutput(
            transformer=TransformerField(
                transformer=self.model.model_copy(update={"submodel_type": SubModelType.Transformer}), loras=[]),
            vae=VAEField(vae=self.model.model_copy(update={"submodel_type": SubModelType.VAE})),
        )
