"""Double of ``invokeai/app/invocations/fields.py`` (InvokeAI 6.14.2): the field kinds and field models a node
pack uses, and ``InputField`` / ``OutputField`` with the release's bookkeeping in ``json_schema_extra``.

Kept as the release does it: ``InputField`` with ``input=Input.Connection`` or ``Input.Any`` and no default
gets the pydantic default None (the decorator then makes its annotation Optional), with ``orig_required``
True, so a graph node can be built before its edge delivers the value; ``invoke_internal`` checks it at
run time. A given default is stored as ``default`` and ``orig_default``; ``Input.Direct`` keeps pydantic's
own required/default handling. ``MetadataField`` is a ``RootModel[dict[str, Any]]``; ``WithMetadata`` and
``WithBoard`` add the reserved ``metadata`` and ``board`` fields (kind "internal").
The descriptions are this double's own words; the UI-only arguments are accepted and stored.
"""
from __future__ import annotations

import logging
from enum import Enum
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter
from pydantic_core import PydanticUndefined

logger = logging.getLogger("InvokeAI")


class Input(str, Enum):
    Connection = "connection"
    Direct = "direct"
    Any = "any"


class FieldKind(str, Enum):
    Input = "input"
    Output = "output"
    Internal = "internal"
    NodeAttribute = "node_attribute"


class UIType(str, Enum):
    """A few of the release's UI type hints (values as there); only the ones node packs commonly pass."""

    Scheduler = "SchedulerField"
    Any = "AnyField"
    _Collection = "CollectionField"
    _CollectionItem = "CollectionItemField"
    _IsIntermediate = "IsIntermediate"


class UIComponent(str, Enum):
    None_ = "none"
    Textarea = "textarea"
    Slider = "slider"


class FieldDescriptions:
    """Attribute names as in the release; the texts are short descriptions of this double's own."""

    unet = "UNet with its scheduler and LoRAs"
    vae = "VAE"
    clip = "CLIP tokenizer, text encoder and LoRAs"
    transformer = "Transformer"
    main_model = "Main model to load"
    flux_model = "FLUX transformer to load"
    qwen_image_model = "Qwen Image transformer to load"
    wan_model = "Wan transformer to load"
    positive_cond = "Positive conditioning"
    negative_cond = "Negative conditioning"
    noise = "Noise latents"
    latents = "Latents"
    denoised_latents = "Denoised latents"
    steps = "Number of steps"
    cfg_scale = "Classifier-free guidance scale"
    denoising_start = "Fraction of the schedule where denoising starts"
    denoising_end = "Fraction of the schedule where denoising ends"
    scheduler = "Scheduler"
    seed = "Seed"
    width = "Width in pixels"
    height = "Height in pixels"
    metadata = "Metadata saved with the image"
    board = "Board to save the image to"
    image = "Image"
    compel_prompt = "Prompt"
    fp32 = "Decode in float32"
    tiled = "Decode in tiles"


class ImageField(BaseModel):
    image_name: str = Field(description="Name of the image")


class BoardField(BaseModel):
    board_id: str = Field(description="Id of the board")


class LatentsField(BaseModel):
    latents_name: str = Field(description="Name of the latents tensor")
    seed: Optional[int] = Field(default=None, description="Seed the latents were made with")


class TensorField(BaseModel):
    tensor_name: str = Field(description="Name of the tensor")


class ConditioningField(BaseModel):
    conditioning_name: str = Field(description="Name of the conditioning")
    mask: Optional[TensorField] = Field(default=None, description="Region the conditioning applies to")


class FluxConditioningField(BaseModel):
    conditioning_name: str = Field(description="Name of the conditioning")
    mask: Optional[TensorField] = Field(default=None, description="Region the conditioning applies to")


class FluxKontextConditioningField(BaseModel):
    image: ImageField = Field(description="The reference image")


class Ideogram4ConditioningField(BaseModel):
    conditioning_name: str = Field(description="The name of conditioning tensor")


class QwenImageConditioningField(BaseModel):
    conditioning_name: str = Field(description="Name of the conditioning")


class MetadataField(RootModel[dict[str, Any]]):
    root: dict[str, Any] = Field(description="Metadata, without a fixed schema")


MetadataFieldValidator = TypeAdapter(MetadataField)


class InputFieldJSONSchemaExtra(BaseModel):
    input: Input
    field_kind: FieldKind
    orig_required: bool = True
    default: Optional[Any] = None
    orig_default: Optional[Any] = None
    ui_hidden: bool = False
    ui_type: Optional[UIType] = None
    ui_component: Optional[UIComponent] = None
    ui_order: Optional[int] = None
    ui_choice_labels: Optional[dict[str, str]] = None
    ui_model_base: Optional[list[Any]] = None
    ui_model_type: Optional[list[Any]] = None
    ui_model_variant: Optional[list[Any]] = None
    ui_model_format: Optional[list[Any]] = None

    model_config = ConfigDict(validate_assignment=True, use_enum_values=True)


class OutputFieldJSONSchemaExtra(BaseModel):
    field_kind: FieldKind
    ui_hidden: bool = False
    ui_order: Optional[int] = None
    ui_type: Optional[UIType] = None

    model_config = ConfigDict(validate_assignment=True, use_enum_values=True)


class WithMetadata(BaseModel):
    """Gives a node the reserved ``metadata`` input; ``context.images.save`` then saves it with the image."""

    metadata: Optional[MetadataField] = Field(
        default=None,
        description=FieldDescriptions.metadata,
        json_schema_extra=InputFieldJSONSchemaExtra(
            field_kind=FieldKind.Internal, input=Input.Connection, orig_required=False
        ).model_dump(exclude_none=True),
    )


class WithBoard(BaseModel):
    """Gives a node the reserved ``board`` input; ``context.images.save`` then files the image there."""

    board: Optional[BoardField] = Field(
        default=None,
        description=FieldDescriptions.board,
        json_schema_extra=InputFieldJSONSchemaExtra(
            field_kind=FieldKind.Internal, input=Input.Direct, orig_required=False
        ).model_dump(exclude_none=True),
    )


def _as_list(value: Any) -> Optional[list[Any]]:
    if value is None:
        return None
    return value if isinstance(value, list) else [value]


def InputField(
    default: Any = PydanticUndefined,
    default_factory: Callable[[], Any] | None = PydanticUndefined,
    title: str | None = PydanticUndefined,
    description: str | None = PydanticUndefined,
    pattern: str | None = PydanticUndefined,
    strict: bool | None = PydanticUndefined,
    gt: float | None = PydanticUndefined,
    ge: float | None = PydanticUndefined,
    lt: float | None = PydanticUndefined,
    le: float | None = PydanticUndefined,
    multiple_of: float | None = PydanticUndefined,
    allow_inf_nan: bool | None = PydanticUndefined,
    max_digits: int | None = PydanticUndefined,
    decimal_places: int | None = PydanticUndefined,
    min_length: int | None = PydanticUndefined,
    max_length: int | None = PydanticUndefined,
    input: Input = Input.Any,
    ui_type: Optional[UIType] = None,
    ui_component: Optional[UIComponent] = None,
    ui_hidden: Optional[bool] = None,
    ui_order: Optional[int] = None,
    ui_choice_labels: Optional[dict[str, str]] = None,
    ui_model_base: Any = None,
    ui_model_type: Any = None,
    ui_model_variant: Any = None,
    ui_model_format: Any = None,
    ui_model_provider_id: Any = None,
) -> Any:
    """A pydantic ``Field`` for a node input, with the release's ``json_schema_extra`` bookkeeping."""
    extra = InputFieldJSONSchemaExtra(input=input, field_kind=FieldKind.Input)
    for name, value in (("ui_component", ui_component), ("ui_hidden", ui_hidden), ("ui_order", ui_order),
                        ("ui_choice_labels", ui_choice_labels), ("ui_type", ui_type)):
        if value is not None:
            setattr(extra, name, value)
    for name, value in (("ui_model_base", ui_model_base), ("ui_model_type", ui_model_type),
                        ("ui_model_variant", ui_model_variant), ("ui_model_format", ui_model_format)):
        if value is not None:
            setattr(extra, name, _as_list(value))

    # As the release: a default_factory is called once, now, and its value becomes the default.
    if default_factory is not PydanticUndefined and default_factory is not None:
        default = default_factory()
        logger.warning('"default_factory" is not supported, calling it now to set "default"')

    given = {"default": default, "title": title, "description": description, "pattern": pattern,
             "strict": strict, "gt": gt, "ge": ge, "lt": lt, "le": le, "multiple_of": multiple_of,
             "allow_inf_nan": allow_inf_nan, "max_digits": max_digits, "decimal_places": decimal_places,
             "min_length": min_length, "max_length": max_length}
    args = {k: v for k, v in given.items() if v is not PydanticUndefined}

    extra.orig_required = default is PydanticUndefined
    if input in (Input.Any, Input.Connection):
        # Connectable fields may be empty when the node is built: the edge fills them at run time.
        args["default"] = None if default is PydanticUndefined else default
        if default is not PydanticUndefined:
            extra.default = default
            extra.orig_default = default
    elif default is not PydanticUndefined:
        args["default"] = default
        extra.orig_default = default
    return Field(**args, json_schema_extra=extra.model_dump(exclude_unset=True))


def OutputField(
    default: Any = PydanticUndefined,
    title: str | None = PydanticUndefined,
    description: str | None = PydanticUndefined,
    ui_type: Optional[UIType] = None,
    ui_hidden: bool = False,
    ui_order: Optional[int] = None,
    **constraints: Any,
) -> Any:
    """A pydantic ``Field`` for a node output (field kind "output")."""
    return Field(
        default=default,
        title=title,
        description=description,
        **constraints,
        json_schema_extra=OutputFieldJSONSchemaExtra(
            ui_hidden=ui_hidden, ui_order=ui_order, ui_type=ui_type, field_kind=FieldKind.Output
        ).model_dump(exclude_none=True),
    )
