"""Double of ``invokeai/app/services/shared/invocation_context.py`` (InvokeAI 6.14.2).

``build_invocation_context(services, data, is_canceled)`` makes one context per node run, as the session
runner does, with the interfaces a node pack meets:
- ``images.save(image, board_id=None, image_category=GENERAL, metadata=None)``: signals "Saving image", takes
  the metadata from the argument, else from the node itself when it is ``WithMetadata`` and has some (the
  JSON of the ``MetadataField``), the board likewise (``WithBoard``), the queue item's workflow and the
  session's source graph (JSON), and hands all that to ``services.images.create``; returns its ImageDTO.
  Also ``get_pil`` (a copy), ``get_metadata``, ``get_dto``.
- ``tensors`` and ``conditioning``: ``save`` returns a name, ``load`` gives it back.
- ``models``: ``exists``, ``load(identifier, submodel_type=None)`` (signals "Loading model NAME (submodel)"
  and returns a ``LoadedModel``), ``get_config``.
- ``util``: ``is_canceled``, ``sd_step_callback(state, base_model)``, ``flux_step_callback(state)`` (base
  ``flux``), ``flux2_step_callback(state)`` (base ``flux2``) and ``signal_progress``. Each step callback raises
  ``CanceledException`` when the session is canceled, else signals "Denoising" with a percentage computed as
  the release's ``calc_percentage`` does; the event records the step state (the release renders a preview
  image from the latents instead).
- ``logger``, ``config``, ``_data`` (``InvocationContextData``) and ``_services``.
"""
from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from PIL.Image import Image

from invokeai.app.invocations.fields import MetadataField, WithBoard, WithMetadata
from invokeai.app.services.image_records.image_records_common import ImageCategory
from invokeai.app.services.session_processor.session_processor_common import CanceledException
from invokeai.backend.model_manager.taxonomy import BaseModelType, SubModelType
from invokeai.backend.stable_diffusion.diffusers_pipeline import PipelineIntermediateState

if TYPE_CHECKING:
    from invokeai.app.invocations.baseinvocation import BaseInvocation
    from invokeai.app.invocations.model import ModelIdentifierField
    from invokeai.app.services.invocation_services import InvocationServices
    from invokeai.app.services.session_queue.session_queue_common import SessionQueueItem


@dataclass
class InvocationContextData:
    queue_item: "SessionQueueItem"
    invocation: "BaseInvocation"
    source_invocation_id: str


class InvocationContextInterface:
    def __init__(self, services: "InvocationServices", data: InvocationContextData) -> None:
        self._services = services
        self._data = data


class LoggerInterface(InvocationContextInterface):
    def debug(self, message: str) -> None:
        self._services.logger.debug(message)

    def info(self, message: str) -> None:
        self._services.logger.info(message)

    def warning(self, message: str) -> None:
        self._services.logger.warning(message)

    def error(self, message: str) -> None:
        self._services.logger.error(message)


class ImagesInterface(InvocationContextInterface):
    def __init__(self, services: "InvocationServices", data: InvocationContextData, util: "UtilInterface") -> None:
        super().__init__(services, data)
        self._util = util

    def save(
        self,
        image: Image,
        board_id: Optional[str] = None,
        image_category: ImageCategory = ImageCategory.GENERAL,
        metadata: Optional[MetadataField] = None,
    ) -> Any:
        self._util.signal_progress("Saving image")
        invocation = self._data.invocation
        metadata_ = None
        if metadata:
            metadata_ = metadata.model_dump_json()
        elif isinstance(invocation, WithMetadata) and invocation.metadata:
            metadata_ = invocation.metadata.model_dump_json()
        board_id_ = None
        if board_id:
            board_id_ = board_id
        elif isinstance(invocation, WithBoard) and invocation.board:
            board_id_ = invocation.board.board_id
        queue_item = self._data.queue_item
        workflow_ = queue_item.workflow.model_dump_json() if getattr(queue_item, "workflow", None) else None
        graph_ = queue_item.session.graph.model_dump_json() if queue_item.session.graph else None
        return self._services.images.create(
            image=image,
            is_intermediate=invocation.is_intermediate,
            image_category=image_category,
            board_id=board_id_,
            metadata=metadata_,
            image_origin="internal",
            workflow=workflow_,
            graph=graph_,
            session_id=queue_item.session_id,
            node_id=invocation.id,
            user_id=queue_item.user_id,
        )

    def get_pil(self, image_name: str, mode: Optional[str] = None) -> Image:
        image = self._services.images.get_pil_image(image_name)
        if mode and mode != image.mode:
            return image.convert(mode)
        return image.copy()

    def get_metadata(self, image_name: str) -> Optional[MetadataField]:
        return self._services.images.get_metadata(image_name)

    def get_dto(self, image_name: str) -> Any:
        return self._services.images.get_dto(image_name)


class TensorsInterface(InvocationContextInterface):
    def save(self, tensor: Any) -> str:
        return self._services.tensors.save(obj=tensor)

    def load(self, name: str) -> Any:
        return self._services.tensors.load(name).clone()


class ConditioningInterface(InvocationContextInterface):
    def save(self, conditioning_data: Any) -> str:
        return self._services.conditioning.save(obj=conditioning_data)

    def load(self, name: str) -> Any:
        return deepcopy(self._services.conditioning.load(name))


class ModelsInterface(InvocationContextInterface):
    def __init__(self, services: "InvocationServices", data: InvocationContextData, util: "UtilInterface") -> None:
        super().__init__(services, data)
        self._util = util

    def exists(self, identifier: Union[str, "ModelIdentifierField"]) -> bool:
        key = identifier if isinstance(identifier, str) else identifier.key
        return self._services.model_manager.store.exists(key)

    def load(self, identifier: Union[str, "ModelIdentifierField"], submodel_type: Optional[SubModelType] = None) -> Any:
        if isinstance(identifier, str):
            model = self._services.model_manager.store.get_model(identifier)
        else:
            submodel_type = submodel_type or identifier.submodel_type
            model = self._services.model_manager.store.get_model(identifier.key)
        message = f"Loading model {model.name}"
        if submodel_type:
            message += f" ({submodel_type.value})"
        self._util.signal_progress(message)
        return self._services.model_manager.load.load_model(model, submodel_type, user_id=self._data.queue_item.user_id)

    def get_config(self, identifier: Union[str, "ModelIdentifierField"]) -> Any:
        key = identifier if isinstance(identifier, str) else identifier.key
        return self._services.model_manager.store.get_model(key)


class ConfigInterface(InvocationContextInterface):
    def get(self) -> Any:
        return self._services.configuration


def calc_percentage(intermediate_state: PipelineIntermediateState) -> float:
    """The progress fraction the release's ``invokeai/app/util/step_callback.py`` reports for a step state."""
    step = intermediate_state.step
    total_steps = intermediate_state.total_steps
    order = intermediate_state.order
    if total_steps == 0:
        return 0.0
    if order == 2:
        # A second-order scheduler reports twice per step; fewer than two steps count as no progress.
        half = total_steps // 2
        return 0.0 if half == 0 else (step // 2) / half
    return step / total_steps


class UtilInterface(InvocationContextInterface):
    def __init__(self, services: "InvocationServices", data: InvocationContextData,
                 is_canceled: Callable[[], bool]) -> None:
        super().__init__(services, data)
        self._is_canceled = is_canceled

    def is_canceled(self) -> bool:
        return self._is_canceled()

    def _step(self, intermediate_state: PipelineIntermediateState, base_model: BaseModelType) -> None:
        if self.is_canceled():
            raise CanceledException
        self._services.events.emit_step(
            queue_item=self._data.queue_item, invocation=self._data.invocation,
            state=intermediate_state, base_model=BaseModelType(base_model),
        )
        self.signal_progress("Denoising", calc_percentage(intermediate_state))

    def sd_step_callback(self, intermediate_state: PipelineIntermediateState, base_model: BaseModelType) -> None:
        self._step(intermediate_state, base_model)

    def flux_step_callback(self, intermediate_state: PipelineIntermediateState) -> None:
        self._step(intermediate_state, BaseModelType.Flux)

    def flux2_step_callback(self, intermediate_state: PipelineIntermediateState) -> None:
        self._step(intermediate_state, BaseModelType.Flux2)

    def signal_progress(self, message: str, percentage: float | None = None, image: Image | None = None,
                        image_size: tuple[int, int] | None = None) -> None:
        self._services.events.emit_invocation_progress(
            queue_item=self._data.queue_item, invocation=self._data.invocation,
            message=message, percentage=percentage, image=image,
        )


class InvocationContext:
    """What a node's ``invoke(context)`` receives."""

    def __init__(self, images: ImagesInterface, tensors: TensorsInterface, conditioning: ConditioningInterface,
                 models: ModelsInterface, logger: LoggerInterface, config: ConfigInterface, util: UtilInterface,
                 data: InvocationContextData, services: "InvocationServices") -> None:
        self.images = images
        self.tensors = tensors
        self.conditioning = conditioning
        self.models = models
        self.logger = logger
        self.config = config
        self.util = util
        self._data = data
        self._services = services


def build_invocation_context(services: "InvocationServices", data: InvocationContextData,
                             is_canceled: Callable[[], bool]) -> InvocationContext:
    util = UtilInterface(services=services, data=data, is_canceled=is_canceled)
    return InvocationContext(
        images=ImagesInterface(services=services, data=data, util=util),
        tensors=TensorsInterface(services=services, data=data),
        conditioning=ConditioningInterface(services=services, data=data),
        models=ModelsInterface(services=services, data=data, util=util),
        logger=LoggerInterface(services=services, data=data),
        config=ConfigInterface(services=services, data=data),
        util=util,
        data=data,
        services=services,
    )
