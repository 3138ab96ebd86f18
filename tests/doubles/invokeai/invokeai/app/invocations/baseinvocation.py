"""Double of ``invokeai/app/invocations/baseinvocation.py`` (InvokeAI 6.14.2).

Kept as the release does it:
- ``BaseInvocation``: a pydantic 2 model (``validate_assignment``, ``coerce_numbers_to_str``) with ``id`` (a
  uuid by default), ``is_intermediate``, ``use_cache``, the ``type`` literal the decorator adds, ``get_type()``,
  ``get_output_annotation()``, and ``invoke_internal(context, services)``: for each field, a missing
  ``orig_default`` is put back, and a required field (``orig_required``, no default) still None fails with
  ``RequiredConnectionException`` (``Input.Connection``) or ``MissingInputException`` (``Input.Any``); then
  ``invoke`` runs, through the invocation cache unless ``services.configuration.node_cache_size`` is 0 or the
  node's ``use_cache`` is False (key: ``services.invocation_cache.create_key(self)``).
- ``@invocation(type, title=, tags=, category=, version=, use_cache=, classification=, bottleneck=)``: the
  type must be non-whitespace; ``node_pack`` is ``cls.__module__.split(".")[0]``; every field must carry the
  ``json_schema_extra`` of ``InputField`` (else ``InvalidFieldError`` from ``validate_fields``, or the
  release's assertion); reserved names refused; a field whose default is None gets ``| None``; the version
  must be semver (``InvalidVersionError``), and without one the release warns and uses "1.0.0"; ``invoke``
  must be implemented and annotated with a ``BaseInvocationOutput`` subclass; a new class is made with
  ``create_model`` and registered, a clobbered type logged as the release words it.
- ``@invocation_output(type)`` and ``InvocationRegistry`` (a set of classes, ``get_invocation_for_type``,
  the discriminated ``TypeAdapter`` on ``type`` the graph validates nodes with, ``unregister_pack``).
Not kept: the allow/deny lists of the app config (every registered node is allowed), UI type migration.
"""
from __future__ import annotations

import inspect
import logging
import re
import sys
import types
import typing
import uuid
import warnings
from abc import ABC, abstractmethod
from enum import Enum
from functools import lru_cache
from inspect import signature
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Iterable, Literal, Optional, Type, TypeVar, Union, cast

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from invokeai.app.invocations.fields import FieldKind, Input, InputFieldJSONSchemaExtra, UIType
from invokeai.app.services.shared.invocation_context import InvocationContext

if TYPE_CHECKING:
    from invokeai.app.services.invocation_services import InvocationServices

logger = logging.getLogger("InvokeAI")

# Semantic Versioning 2.0.0's grammar (major.minor.patch, optional pre-release and build parts).
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def uuid_string() -> str:
    return str(uuid.uuid4())


class InvalidVersionError(ValueError):
    pass


class InvalidFieldError(TypeError):
    pass


class Classification(str, Enum):
    Stable = "stable"
    Beta = "beta"
    Prototype = "prototype"
    Deprecated = "deprecated"
    Internal = "internal"
    Special = "special"


class Bottleneck(str, Enum):
    Network = "network"
    GPU = "gpu"


class UIConfigBase(BaseModel):
    tags: Optional[list[str]] = None
    title: Optional[str] = None
    category: Optional[str] = None
    version: str
    node_pack: str
    classification: Classification = Classification.Stable

    model_config = ConfigDict(validate_assignment=True)


class BaseInvocationOutput(BaseModel):
    """Base of every node output; ``@invocation_output`` adds its ``type``."""

    output_meta: Optional[dict[str, JsonValue]] = Field(
        default=None, json_schema_extra={"field_kind": FieldKind.NodeAttribute}
    )

    @classmethod
    def get_type(cls) -> str:
        return cls.model_fields["type"].default

    _original_model_fields: ClassVar[dict[str, Any]] = {}

    model_config = ConfigDict(protected_namespaces=(), validate_assignment=True)


class RequiredConnectionException(Exception):
    def __init__(self, node_id: str, field_name: str):
        super().__init__(f"Node {node_id} missing connections for field {field_name}")


class MissingInputException(Exception):
    def __init__(self, node_id: str, field_name: str):
        super().__init__(f"Node {node_id} missing value or connection for field {field_name}")


class BaseInvocation(ABC, BaseModel):
    """Base of every node; ``@invocation`` registers a subclass and adds its ``type``."""

    @classmethod
    def get_type(cls) -> str:
        return cls.model_fields["type"].default

    @classmethod
    def get_output_annotation(cls) -> Type[BaseInvocationOutput]:
        return signature(cls.invoke).return_annotation

    @abstractmethod
    def invoke(self, context: InvocationContext) -> BaseInvocationOutput:
        pass

    def get_event_invocation(self) -> "BaseInvocation":
        return self

    def invoke_internal(self, context: InvocationContext, services: "InvocationServices") -> BaseInvocationOutput:
        for field_name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if not extra or callable(extra):
                continue
            orig_default = extra.get("orig_default", PydanticUndefined)
            orig_required = extra.get("orig_required", True)
            input_ = extra.get("input", None)
            if orig_default is not PydanticUndefined and not hasattr(self, field_name):
                setattr(self, field_name, orig_default)
            if orig_required and orig_default is PydanticUndefined and getattr(self, field_name) is None:
                # The exception names the node's type, not its id, as the release's does.
                if input_ == Input.Connection:
                    raise RequiredConnectionException(type(self).model_fields["type"].default, field_name)
                elif input_ == Input.Any:
                    raise MissingInputException(type(self).model_fields["type"].default, field_name)

        if services.configuration.node_cache_size == 0:
            return self.invoke(context)
        if not self.use_cache:
            services.logger.debug(f'Skipping invocation cache for "{self.get_type()}": {self.id}')
            return self.invoke(context)
        key = services.invocation_cache.create_key(self)
        cached = services.invocation_cache.get(key)
        if cached is not None:
            services.logger.debug(f'Invocation cache hit for type "{self.get_type()}": {self.id}')
            return cached
        services.logger.debug(f'Invocation cache miss for type "{self.get_type()}": {self.id}')
        output = self.invoke(context)
        services.invocation_cache.save(key, output)
        return output

    id: str = Field(default_factory=uuid_string, json_schema_extra={"field_kind": FieldKind.NodeAttribute})
    is_intermediate: bool = Field(
        default=False,
        json_schema_extra=InputFieldJSONSchemaExtra(
            input=Input.Direct, field_kind=FieldKind.NodeAttribute, ui_type=UIType._IsIntermediate
        ).model_dump(exclude_none=True),
    )
    use_cache: bool = Field(default=True, json_schema_extra={"field_kind": FieldKind.NodeAttribute})

    bottleneck: ClassVar[Bottleneck]
    idle_gpu_offloadable: ClassVar[bool] = False
    UIConfig: ClassVar[UIConfigBase]

    model_config = ConfigDict(
        protected_namespaces=(),
        validate_assignment=True,
        coerce_numbers_to_str=True,
    )

    _original_model_fields: ClassVar[dict[str, Any]] = {}


TBaseInvocation = TypeVar("TBaseInvocation", bound=BaseInvocation)
TBaseInvocationOutput = TypeVar("TBaseInvocationOutput", bound=BaseInvocationOutput)


class InvocationRegistry:
    _invocation_classes: ClassVar[set[type[BaseInvocation]]] = set()
    _output_classes: ClassVar[set[type[BaseInvocationOutput]]] = set()

    @classmethod
    def register_invocation(cls, invocation: type[BaseInvocation]) -> None:
        invocation_type = invocation.get_type()
        node_pack = invocation.UIConfig.node_pack
        clobbered = cls.get_invocation_for_type(invocation_type)
        if clobbered is not None:
            clobbered_pack = clobbered.UIConfig.node_pack
            if clobbered_pack == "invokeai":
                logger.warning(f'Overriding core node "{invocation_type}" with node from "{node_pack}"')
            else:
                # The release names the two packs in this order (the new one first).
                logger.warning(
                    f'Overriding node "{invocation_type}" from "{node_pack}" with node from "{clobbered_pack}"'
                )
            cls._invocation_classes.remove(clobbered)
        cls._invocation_classes.add(invocation)
        cls.invalidate_invocation_typeadapter()

    @classmethod
    @lru_cache(maxsize=1)
    def get_invocation_typeadapter(cls) -> TypeAdapter[Any]:
        return TypeAdapter(Annotated[Union[tuple(cls.get_invocation_classes())], Field(discriminator="type")])

    @classmethod
    def invalidate_invocation_typeadapter(cls) -> None:
        cls.get_invocation_typeadapter.cache_clear()

    @classmethod
    def unregister_pack(cls, node_pack: str) -> list[str]:
        removed = {inv for inv in cls._invocation_classes if inv.UIConfig.node_pack == node_pack}
        cls._invocation_classes -= removed
        if removed:
            cls.invalidate_invocation_typeadapter()
        outputs = {out for out in cls._output_classes if out.__module__.split(".")[0] == node_pack}
        cls._output_classes -= outputs
        if outputs:
            cls.invalidate_output_typeadapter()
        return [inv.get_type() for inv in removed]

    @classmethod
    def get_invocation_classes(cls) -> Iterable[type[BaseInvocation]]:
        return set(cls._invocation_classes)

    @classmethod
    def get_invocations_map(cls) -> dict[str, type[BaseInvocation]]:
        return {i.get_type(): i for i in cls.get_invocation_classes()}

    @classmethod
    def get_invocation_types(cls) -> Iterable[str]:
        return (i.get_type() for i in cls.get_invocation_classes())

    @classmethod
    def get_invocation_for_type(cls, invocation_type: str) -> type[BaseInvocation] | None:
        return cls.get_invocations_map().get(invocation_type)

    @classmethod
    def register_output(cls, output: type[BaseInvocationOutput]) -> None:
        output_type = output.get_type()
        clobbered = cls.get_output_for_type(output_type)
        if clobbered is not None:
            logger.warning(f'Overriding invocation output "{output_type}"')
            cls._output_classes.remove(clobbered)
        cls._output_classes.add(output)
        cls.invalidate_output_typeadapter()

    @classmethod
    def get_output_classes(cls) -> Iterable[type[BaseInvocationOutput]]:
        return cls._output_classes

    @classmethod
    def get_outputs_map(cls) -> dict[str, type[BaseInvocationOutput]]:
        return {o.get_type(): o for o in cls.get_output_classes()}

    @classmethod
    @lru_cache(maxsize=1)
    def get_output_typeadapter(cls) -> TypeAdapter[Any]:
        return TypeAdapter(Annotated[Union[tuple(cls._output_classes)], Field(discriminator="type")])

    @classmethod
    def invalidate_output_typeadapter(cls) -> None:
        cls.get_output_typeadapter.cache_clear()

    @classmethod
    def get_output_types(cls) -> Iterable[str]:
        return (o.get_type() for o in cls.get_output_classes())

    @classmethod
    def get_output_for_type(cls, output_type: str) -> type[BaseInvocationOutput] | None:
        return cls.get_outputs_map().get(output_type)


RESERVED_NODE_ATTRIBUTE_FIELD_NAMES = {"id", "is_intermediate", "use_cache", "type", "workflow", "bottleneck",
                                       "idle_gpu_offloadable"}
RESERVED_INPUT_FIELD_NAMES = {"metadata", "board"}
RESERVED_OUTPUT_FIELD_NAMES = {"type", "output_meta"}

with warnings.catch_warnings():
    warnings.simplefilter("ignore", category=DeprecationWarning)
    # Every attribute and method of a plain pydantic model: a field may not take one of those names.
    RESERVED_PYDANTIC_FIELD_NAMES = {name for name, _ in inspect.getmembers(type("_Model", (BaseModel,), {})())}


def validate_fields(model_fields: dict[str, FieldInfo], model_type: str) -> None:
    kinds = {k.value for k in FieldKind}
    for name, field in model_fields.items():
        if name in RESERVED_PYDANTIC_FIELD_NAMES:
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field name (reserved by pydantic)")
        if not field.annotation:
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field type (missing annotation)")
        if not isinstance(field.json_schema_extra, dict):
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field definition (missing json_schema_extra dict)")
        kind = field.json_schema_extra.get("field_kind", None)
        if kind not in kinds:
            raise InvalidFieldError(
                f"{model_type}.{name}: Invalid field definition for (maybe it's not an InputField or OutputField?)"
            )
        if kind == FieldKind.Input.value and (name in RESERVED_NODE_ATTRIBUTE_FIELD_NAMES
                                              or name in RESERVED_INPUT_FIELD_NAMES):
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field name (reserved input field name)")
        if kind == FieldKind.Output.value and name in RESERVED_OUTPUT_FIELD_NAMES:
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field name (reserved output field name)")
        if kind == FieldKind.Internal.value and name not in RESERVED_INPUT_FIELD_NAMES:
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field name (internal field without reserved name)")
        if (kind == FieldKind.NodeAttribute.value and name not in RESERVED_NODE_ATTRIBUTE_FIELD_NAMES
                and name not in RESERVED_OUTPUT_FIELD_NAMES):
            raise InvalidFieldError(f"{model_type}.{name}: Invalid field name (node attribute field without reserved name)")


def is_optional(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is not typing.Union and origin is not types.UnionType:
        return False
    return any(arg is type(None) for arg in typing.get_args(annotation))


def _validate_default(cls_name: str, field_name: str, invocation_type: str, annotation: Any, info: FieldInfo) -> None:
    """An ``orig_default`` must itself be valid for the field (checked with a one-field model)."""
    assert isinstance(info.json_schema_extra, dict)
    if "orig_default" not in info.json_schema_extra:
        return
    checker = cast(type[BaseModel], create_model(cls_name, **{field_name: (annotation, info)}))
    try:
        checker.model_validate({field_name: info.json_schema_extra["orig_default"]})
    except Exception as e:
        raise InvalidFieldError(
            f'Default value for field "{field_name}" on invocation "{invocation_type}" is invalid, {e}'
        ) from e


def invocation(
    invocation_type: str,
    title: Optional[str] = None,
    tags: Optional[list[str]] = None,
    category: Optional[str] = None,
    version: Optional[str] = None,
    use_cache: Optional[bool] = True,
    classification: Classification = Classification.Stable,
    bottleneck: Bottleneck = Bottleneck.GPU,
    idle_gpu_offloadable: bool = False,
) -> Callable[[Type[TBaseInvocation]], Type[TBaseInvocation]]:
    """Registers a node class under ``invocation_type``."""

    def wrapper(cls: Type[TBaseInvocation]) -> Type[TBaseInvocation]:
        if re.match(r"^\S+$", invocation_type) is None:
            raise ValueError(f'"invocation_type" must consist of non-whitespace characters, got "{invocation_type}"')
        node_pack = cls.__module__.split(".")[0]
        validate_fields(cls.model_fields, invocation_type)

        fields: dict[str, tuple[Any, FieldInfo]] = {}
        original: dict[str, Any] = {}
        for field_name, info in cls.model_fields.items():
            annotation = info.annotation
            assert annotation is not None, f"{field_name} on invocation {invocation_type} has no type annotation."
            assert isinstance(info.json_schema_extra, dict), (
                f"{field_name} on invocation {invocation_type} has a non-dict json_schema_extra, "
                "did you forget to use InputField?"
            )
            original[field_name] = {"annotation": annotation, "field_info": info}
            _validate_default(cls.__name__, field_name, invocation_type, annotation, info)
            # A connectable field defaults to None until its edge fills it: its type must admit None.
            if info.default is None and not is_optional(annotation):
                annotation = annotation | None
            fields[field_name] = (annotation, info)

        if version is not None:
            if not _SEMVER.match(version):
                raise InvalidVersionError(f'Invalid version string for node "{invocation_type}": "{version}"')
            resolved_version = version
        else:
            logger.warning(f'No version specified for node "{invocation_type}", using "1.0.0"')
            resolved_version = "1.0.0"
        cls.UIConfig = UIConfigBase(title=title, tags=tags, category=category, classification=classification,
                                    node_pack=node_pack, version=resolved_version)
        if use_cache is not None:
            cls.model_fields["use_cache"].default = use_cache
        cls.bottleneck = bottleneck
        cls.idle_gpu_offloadable = idle_gpu_offloadable

        fields["type"] = (
            Literal[invocation_type],
            cast(FieldInfo, Field(title="type", default=invocation_type,
                                  json_schema_extra={"field_kind": FieldKind.NodeAttribute})),
        )

        if "invoke" in cls.__abstractmethods__:
            raise ValueError(f'Invocation "{invocation_type}" must implement the "invoke" method')
        returns = signature(cls.invoke).return_annotation
        try:
            # With postponed annotations the return annotation is a string naming a class of the node's module.
            if isinstance(returns, str):
                returns = getattr(sys.modules[cls.__module__], returns)
            if returns is BaseInvocationOutput or not issubclass(returns, BaseInvocationOutput):
                raise TypeError
        except Exception:
            raise ValueError(
                f'Invocation "{invocation_type}" must have a return annotation of a subclass of '
                f'BaseInvocationOutput (got "{returns}")'
            )

        docstring = cls.__doc__
        new_class = create_model(cls.__qualname__, __base__=cls, __module__=cls.__module__, **fields)  # type: ignore
        new_class.__doc__ = docstring
        new_class._original_model_fields = original
        InvocationRegistry.register_invocation(new_class)
        return new_class

    return wrapper


def invocation_output(output_type: str) -> Callable[[Type[TBaseInvocationOutput]], Type[TBaseInvocationOutput]]:
    """Registers an output class under ``output_type``."""

    def wrapper(cls: Type[TBaseInvocationOutput]) -> Type[TBaseInvocationOutput]:
        if re.match(r"^\S+$", output_type) is None:
            raise ValueError(f'"output_type" must consist of non-whitespace characters, got "{output_type}"')
        validate_fields(cls.model_fields, output_type)
        fields: dict[str, tuple[Any, FieldInfo]] = {}
        for field_name, info in cls.model_fields.items():
            annotation = info.annotation
            assert annotation is not None, f"{field_name} on invocation output {output_type} has no type annotation."
            assert isinstance(info.json_schema_extra, dict), (
                f"{field_name} on invocation output {output_type} has a non-dict json_schema_extra, "
                "did you forget to use InputField?"
            )
            if info.default is not PydanticUndefined and is_optional(annotation):
                annotation = annotation | None
            fields[field_name] = (annotation, info)
        fields["type"] = (
            Literal[output_type],
            cast(FieldInfo, Field(title="type", default=output_type,
                                  json_schema_extra={"field_kind": FieldKind.NodeAttribute})),
        )
        docstring = cls.__doc__
        new_class = create_model(cls.__qualname__, __base__=cls, __module__=cls.__module__, **fields)
        new_class.__doc__ = docstring
        InvocationRegistry.register_output(new_class)
        return new_class

    return wrapper
