"""The host around the InvokeAI double: in-memory services, graphs of the core nodes, and the runner.

    from invokeai_host import InvokeHost, txt2img_graph, insert_on_edge

    host = InvokeHost()                               # node_cache_size=512 as the release's default
    graph = txt2img_graph(seed=42, steps=2)           # model_loader, positive, negative, noise, denoise, l2i, metadata
    item = host.run_graph(graph)                      # DefaultSessionRunner.run on a queue item, in this thread
    assert item.status == "completed", item.error_traceback
    host.output(item, "l2i").image.image_name         # a node's output, by its source id
    host.images.get_metadata(name)                    # MetadataField (core_metadata's) or None
    items = host.run_concurrently([g1, g2])           # one runner per graph, threads session_processor_0, _1

Every graph builder sets ``use_cache=False`` on its nodes, as a repeated run needs (with the cache on, the
release answers a repeated node from the cache without running it). ``host.events`` records what the
context signalled: every step state a denoise node handed to a step callback (``host.events.steps``), each
with the session, node and thread.
"""
from __future__ import annotations

import datetime
import importlib
import io
import itertools
import logging
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, InvocationRegistry
from invokeai.app.invocations.fields import MetadataField
from invokeai.app.invocations.load_custom_nodes import load_custom_nodes
from invokeai.app.invocations.model import ModelIdentifierField
from invokeai.app.services.invocation_cache.invocation_cache_memory import MemoryInvocationCache
from invokeai.app.services.invocation_services import InvocationServices
from invokeai.app.services.session_processor.session_processor_default import DefaultSessionRunner
from invokeai.app.services.session_queue.session_queue_common import SessionQueueItem, SessionQueueItemNotFoundError
from invokeai.app.services.shared.graph import Edge, EdgeConnection, Graph, GraphExecutionState
from invokeai.backend.model_manager.taxonomy import ModelType
from invokeai_tiny_models import INSTALLED, ModelConfig, ModelManager

CORE_NODE_MODULES = ("compel", "denoise_latents", "flux2_denoise", "flux_denoise", "ideogram4_denoise", "latents_to_image", "metadata", "noise",
                     "qwen_image_denoise")
# Importing a node module registers its nodes; the release imports all of its core node modules at startup.
for _module in CORE_NODE_MODULES:
    importlib.import_module(f"invokeai.app.invocations.{_module}")

logger = logging.getLogger("InvokeAI")


@dataclass
class AppConfig:
    """The settings of the release's ``InvokeAIAppConfig`` that the doubles read (release defaults)."""

    node_cache_size: int = 512
    multiuser: bool = False
    attention_type: str = "auto"  # auto, normal, xformers, sliced, torch-sdp (config_default.py)
    attention_slice_size: str = "auto"  # auto, balanced, max, or 1-8


@dataclass
class ImageDTO:
    image_name: str
    width: int
    height: int
    image_category: str
    is_intermediate: bool
    board_id: Optional[str]
    session_id: Optional[str]
    node_id: Optional[str]
    user_id: str


@dataclass
class SavedImage:
    image: Image.Image
    dto: ImageDTO
    metadata: Optional[str]
    graph: Optional[str]
    workflow: Optional[str]

    def png(self) -> bytes:
        """The PNG as the release writes it: metadata and graph as ``invokeai_metadata``/``invokeai_graph`` text."""
        info = PngInfo()
        for key, value in (("invokeai_metadata", self.metadata), ("invokeai_workflow", self.workflow),
                           ("invokeai_graph", self.graph)):
            if value is not None:
                info.add_text(key, value)
        buffer = io.BytesIO()
        self.image.save(buffer, "PNG", pnginfo=info)
        return buffer.getvalue()


class ImageStore:
    """``services.images``: ``create`` keeps the image with its metadata, graph and workflow JSON."""

    def __init__(self) -> None:
        self.saved: dict[str, SavedImage] = {}
        self._on_deleted: list = []

    def on_deleted(self, callback) -> None:
        """As the release's stores: ``callback(name)`` after one of this store's items is deleted."""
        self._on_deleted.append(callback)

    def delete(self, image_name: str) -> None:
        del self.saved[image_name]
        for callback in self._on_deleted:
            callback(image_name)

    def create(self, image: Image.Image, image_origin: str, image_category: Any, is_intermediate: bool = False,
               board_id: Optional[str] = None, session_id: Optional[str] = None, node_id: Optional[str] = None,
               metadata: Optional[str] = None, workflow: Optional[str] = None, graph: Optional[str] = None,
               user_id: str = "system") -> ImageDTO:
        name = f"{uuid.uuid4()}.png"
        dto = ImageDTO(image_name=name, width=image.width, height=image.height,
                       image_category=getattr(image_category, "value", image_category),
                       is_intermediate=is_intermediate, board_id=board_id, session_id=session_id, node_id=node_id,
                       user_id=user_id)
        self.saved[name] = SavedImage(image=image.copy(), dto=dto, metadata=metadata, graph=graph, workflow=workflow)
        return dto

    def get_pil_image(self, image_name: str) -> Image.Image:
        return self.saved[image_name].image

    def get_metadata(self, image_name: str) -> Optional[MetadataField]:
        raw = self.saved[image_name].metadata
        return None if raw is None else MetadataField.model_validate_json(raw)

    def get_dto(self, image_name: str) -> ImageDTO:
        return self.saved[image_name].dto


class ObjectStore:
    """``services.tensors`` / ``services.conditioning``: ``save(obj)`` -> a name, ``load(name)``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._objects: dict[str, Any] = {}
        self._on_deleted: list = []

    def on_deleted(self, callback) -> None:
        self._on_deleted.append(callback)

    def delete(self, name: str) -> None:
        del self._objects[name]
        for callback in self._on_deleted:
            callback(name)

    def save(self, obj: Any) -> str:
        name = f"{self._prefix}_{uuid.uuid4()}"
        self._objects[name] = obj
        return name

    def load(self, name: str) -> Any:
        return self._objects[name]


@dataclass
class EventLog:
    """``services.events``: what the runner and the contexts emitted, with the thread each came from."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def _emit(self, kind: str, queue_item: Any, invocation: Any, **data: Any) -> None:
        self.events.append({"event": kind, "session_id": queue_item.session_id, "node_id": invocation.id,
                            "node_type": invocation.get_type(), "thread": threading.current_thread().name, **data})

    def emit_invocation_started(self, queue_item: Any, invocation: Any) -> None:
        self._emit("invocation_started", queue_item, invocation)

    def emit_invocation_complete(self, queue_item: Any, invocation: Any, output: Any) -> None:
        # As the release's InvocationCompleteEvent: its result is checked against the registered output classes
        # (a pydantic ValidationError here fails the node).
        InvocationRegistry.get_output_typeadapter().validate_python(output)
        self._emit("invocation_complete", queue_item, invocation, output=output)

    def emit_invocation_error(self, queue_item: Any, invocation: Any, error_type: str, error_message: str,
                              error_traceback: str) -> None:
        self._emit("invocation_error", queue_item, invocation, error_type=error_type, error_message=error_message)

    def emit_invocation_progress(self, queue_item: Any, invocation: Any, message: str,
                                 percentage: Optional[float] = None, image: Any = None) -> None:
        self._emit("invocation_progress", queue_item, invocation, message=message, percentage=percentage)

    def emit_step(self, queue_item: Any, invocation: Any, state: Any, base_model: Any) -> None:
        self._emit("step", queue_item, invocation, state=state, base_model=base_model)

    def steps(self, session_id: Optional[str] = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step" and session_id in (None, e["session_id"])]


class SessionQueue:
    """``services.session_queue``: the calls the runner makes on a queue item."""

    def __init__(self) -> None:
        self.items: dict[int, SessionQueueItem] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def enqueue(self, graph: Graph, queue_id: str = "default", user_id: str = "system") -> SessionQueueItem:
        session = GraphExecutionState(graph=graph)
        now = datetime.datetime.now()
        with self._lock:
            item = SessionQueueItem(item_id=next(self._ids), batch_id=str(uuid.uuid4()), session_id=session.id,
                                    queue_id=queue_id, user_id=user_id, session=session, created_at=now,
                                    updated_at=now, started_at=None, completed_at=None)
            self.items[item.item_id] = item
        return item

    def get_queue_item(self, item_id: int) -> SessionQueueItem:
        """A copy of the item as stored now (the release reads it from its database each time)."""
        item = self.items.get(item_id)
        if item is None:
            raise SessionQueueItemNotFoundError(f"No queue item with id {item_id}")
        return item.model_copy()

    def delete_queue_item(self, item_id: int) -> None:
        self.items.pop(item_id, None)

    def set_queue_item_session(self, item_id: int, session: GraphExecutionState) -> SessionQueueItem:
        self.items[item_id].session = session
        return self.items[item_id]

    def complete_queue_item(self, item_id: int, queue_item: Optional[SessionQueueItem] = None) -> SessionQueueItem:
        self.items[item_id].status = "completed"
        self.items[item_id].completed_at = datetime.datetime.now()
        return self.items[item_id]

    def fail_queue_item(self, item_id: int, error_type: str, error_message: str,
                        error_traceback: str) -> SessionQueueItem:
        item = self.items[item_id]
        item.status, item.error_type, item.error_message = "failed", error_type, error_message
        item.error_traceback = error_traceback
        return item


def model_identifier(name: str = "tiny-sd15") -> ModelIdentifierField:
    """The identifier a graph names an installed main model with (tiny-sd15, tiny-flux, tiny-qwen-image)."""
    config: ModelConfig = next(c for c in INSTALLED if c.name == name)
    return ModelIdentifierField(key=config.key, hash=config.hash, name=config.name, base=config.base,
                                type=ModelType.Main)


def _edge(source: str, source_field: str, destination: str, destination_field: str) -> dict[str, Any]:
    return {"source": {"node_id": source, "field": source_field},
            "destination": {"node_id": destination, "field": destination_field}}


def _graph(nodes: dict[str, dict[str, Any]], edges: list[dict[str, Any]], use_cache: bool) -> Graph:
    return Graph.model_validate({"nodes": {k: {"id": k, "use_cache": use_cache, **v} for k, v in nodes.items()},
                                 "edges": edges})


def txt2img_graph(seed: int = 42, steps: int = 2, width: int = 64, height: int = 64, prompt: str = "a photo of a cat",
                  negative: str = "", scheduler: str = "euler", cfg_scale: float = 7.0, metadata: bool = True,
                  use_cache: bool = False) -> Graph:
    """The SD1.5 txt2img graph of an InvokeAI client (node ids as in the docs' example): model_loader,
    positive, negative, noise, denoise, l2i and, with ``metadata``, core_metadata wired to l2i.metadata."""
    model = model_identifier("tiny-sd15").model_dump(mode="json")
    nodes = {
        "model_loader": {"type": "main_model_loader", "model": model},
        "positive": {"type": "compel", "prompt": prompt},
        "negative": {"type": "compel", "prompt": negative},
        "noise": {"type": "noise", "seed": seed, "width": width, "height": height, "use_cpu": True},
        "denoise": {"type": "denoise_latents", "steps": steps, "cfg_scale": cfg_scale, "scheduler": scheduler,
                    "denoising_start": 0.0, "denoising_end": 1.0},
        "l2i": {"type": "l2i", "fp32": True, "is_intermediate": False},
    }
    edges = [_edge("model_loader", "unet", "denoise", "unet"), _edge("model_loader", "clip", "positive", "clip"),
             _edge("model_loader", "clip", "negative", "clip"),
             _edge("positive", "conditioning", "denoise", "positive_conditioning"),
             _edge("negative", "conditioning", "denoise", "negative_conditioning"),
             _edge("noise", "noise", "denoise", "noise"), _edge("denoise", "latents", "l2i", "latents"),
             _edge("model_loader", "vae", "l2i", "vae")]
    if metadata:
        nodes["metadata"] = {"type": "core_metadata", "generation_mode": "txt2img", "positive_prompt": prompt,
                             "negative_prompt": negative, "width": width, "height": height, "seed": seed,
                             "rand_device": "cpu", "cfg_scale": cfg_scale, "steps": steps, "scheduler": scheduler,
                             "model": model}
        edges.append(_edge("metadata", "metadata", "l2i", "metadata"))
    return _graph(nodes, edges, use_cache)


def flux_graph(seed: int = 0, steps: int = 2, width: int = 32, height: int = 32, prompt: str = "a lighthouse",
               use_cache: bool = False) -> Graph:
    """model_loader (transformer_model_loader) -> prompt (flux_text_encoder) -> denoise (flux_denoise)."""
    nodes = {
        "model_loader": {"type": "transformer_model_loader", "model": model_identifier("tiny-flux").model_dump(mode="json")},
        "prompt": {"type": "flux_text_encoder", "prompt": prompt},
        "denoise": {"type": "flux_denoise", "num_steps": steps, "width": width, "height": height, "seed": seed},
    }
    edges = [_edge("model_loader", "transformer", "prompt", "transformer"),
             _edge("model_loader", "transformer", "denoise", "transformer"),
             _edge("prompt", "conditioning", "denoise", "positive_text_conditioning")]
    return _graph(nodes, edges, use_cache)


def flux2_graph(seed: int = 0, steps: int = 2, width: int = 32, height: int = 32, prompt: str = "a lighthouse",
                references: tuple = (), use_cache: bool = False) -> Graph:
    """model_loader (transformer_model_loader: transformer and VAE) -> prompt (flux_text_encoder) -> denoise
    (flux2_denoise), with a ``flux_kontext`` node for the image named in ``references`` (one image already in
    the store: the release collects several into a list, which this double has no node for)."""
    nodes = {
        "model_loader": {"type": "transformer_model_loader", "model": model_identifier("tiny-flux2").model_dump(mode="json")},
        "prompt": {"type": "flux_text_encoder", "prompt": prompt},
        "denoise": {"type": "flux2_denoise", "num_steps": steps, "width": width, "height": height, "seed": seed},
    }
    edges = [_edge("model_loader", "transformer", "prompt", "transformer"),
             _edge("model_loader", "transformer", "denoise", "transformer"),
             _edge("model_loader", "vae", "denoise", "vae"),
             _edge("prompt", "conditioning", "denoise", "positive_text_conditioning")]
    if len(references) > 1:
        raise ValueError("this double has no collect node: one reference image")
    for index, name in enumerate(references):
        nodes[f"reference_{index}"] = {"type": "flux_kontext", "image": {"image_name": name}}
        edges.append(_edge(f"reference_{index}", "kontext_cond", "denoise", "kontext_conditioning"))
    return _graph(nodes, edges, use_cache)


def ideogram4_graph(seed: int = 0, steps: Optional[int] = None, preset: str = "V4_TURBO_12", width: int = 32,
                    height: int = 32, prompt: str = "a lighthouse", use_cache: bool = False) -> Graph:
    """model_loader -> prompt (ideogram4_text_encoder) -> denoise (ideogram4_denoise; ``steps`` None: the
    preset's, as the release's default)."""
    denoise = {"type": "ideogram4_denoise", "sampler_preset": preset, "width": width, "height": height, "seed": seed}
    if steps is not None:
        denoise["steps"] = steps
    nodes = {
        "model_loader": {"type": "transformer_model_loader",
                         "model": model_identifier("tiny-ideogram4").model_dump(mode="json")},
        "prompt": {"type": "ideogram4_text_encoder", "prompt": prompt},
        "denoise": denoise,
    }
    edges = [_edge("model_loader", "transformer", "denoise", "transformer"),
             _edge("prompt", "conditioning", "denoise", "positive_conditioning")]
    return _graph(nodes, edges, use_cache)


def qwen_image_graph(seed: int = 0, steps: int = 2, width: int = 32, height: int = 32, prompt: str = "a lighthouse",
                     negative: Optional[str] = " ", cfg_scale: float = 4.0, use_cache: bool = False) -> Graph:
    """model_loader -> positive/negative (qwen_image_text_encoder) -> denoise (qwen_image_denoise)."""
    nodes = {
        "model_loader": {"type": "transformer_model_loader",
                         "model": model_identifier("tiny-qwen-image").model_dump(mode="json")},
        "positive": {"type": "qwen_image_text_encoder", "prompt": prompt},
        "denoise": {"type": "qwen_image_denoise", "steps": steps, "width": width, "height": height, "seed": seed,
                    "cfg_scale": cfg_scale},
    }
    edges = [_edge("model_loader", "transformer", "denoise", "transformer"),
             _edge("positive", "conditioning", "denoise", "positive_conditioning")]
    if negative is not None:
        nodes["negative"] = {"type": "qwen_image_text_encoder", "prompt": negative}
        edges.append(_edge("negative", "conditioning", "denoise", "negative_conditioning"))
    return _graph(nodes, edges, use_cache)


def insert_on_edge(graph: Graph, node: BaseInvocation | dict[str, Any], destination: tuple[str, str],
                   input_field: str, output_field: Optional[str] = None) -> Graph:
    """Puts ``node`` on the edge that ends at ``destination`` (node id, field): the edge's source goes to
    ``node.input_field`` and ``node.output_field`` (default: the same name) to the destination, as a client
    replaces an edge. A dict node is validated as the graph would (``type`` picks the class)."""
    if isinstance(node, dict):
        node = InvocationRegistry.get_invocation_typeadapter().validate_python(node)
    (old,) = graph._get_input_edges(*destination)
    graph.delete_edge(old)
    graph.add_node(node)
    graph.add_edge(Edge(source=old.source, destination=EdgeConnection(node_id=node.id, field=input_field)))
    graph.add_edge(Edge(source=EdgeConnection(node_id=node.id, field=output_field or input_field),
                        destination=old.destination))
    return graph


def node_types_by_pack() -> dict[str, list[str]]:
    """The node types of each node pack, grouped as ``GET /api/v2/custom_nodes/`` groups them (by
    ``UIConfig.node_pack``; "invokeai" for the core nodes)."""
    packs: dict[str, list[str]] = {}
    for cls in InvocationRegistry._invocation_classes:
        packs.setdefault(cls.UIConfig.node_pack, []).append(cls.get_type())
    return {pack: sorted(types) for pack, types in packs.items()}


class InvokeHost:
    """The services of one InvokeAI process, and the session runner used as its processor uses it."""

    def __init__(self, node_cache_size: int = 512) -> None:
        self.configuration = AppConfig(node_cache_size=node_cache_size)
        self.invocation_cache = MemoryInvocationCache(max_cache_size=node_cache_size)
        self.images = ImageStore()
        self.events = EventLog()
        self.session_queue = SessionQueue()
        self.services = InvocationServices(
            configuration=self.configuration, invocation_cache=self.invocation_cache, logger=logger,
            images=self.images, tensors=ObjectStore("tensor"), conditioning=ObjectStore("conditioning"),
            videos=ObjectStore("video"), model_manager=ModelManager(), events=self.events,
            session_queue=self.session_queue)
        self.invocation_cache.start(types.SimpleNamespace(services=self.services))  # as the invoker starts it

    def load_node_packs(self, custom_nodes_path: Path) -> list[str]:
        """Loads every pack folder there as the release does at startup (``load_custom_nodes``)."""
        return load_custom_nodes(Path(custom_nodes_path), logger)

    def run_graph(self, graph: Graph, cancel_event: Optional[threading.Event] = None,
                  runner: Optional[DefaultSessionRunner] = None) -> SessionQueueItem:
        """Enqueues ``graph`` and runs it to its end in this thread with a ``DefaultSessionRunner``."""
        item = self.session_queue.enqueue(graph)
        item.status, item.started_at = "in_progress", datetime.datetime.now()
        runner = runner or DefaultSessionRunner()
        runner.start(self.services, cancel_event or threading.Event())
        runner.run(item)
        return item

    def run_concurrently(self, graphs: list[Graph]) -> list[SessionQueueItem]:
        """Runs each graph in its own thread, named ``session_processor_N`` as the release names its workers
        (one per generation device), all started together; returns the queue items in the graphs' order."""
        items: list[Optional[SessionQueueItem]] = [None] * len(graphs)
        errors: list[BaseException] = []
        start = threading.Barrier(len(graphs))

        def work(index: int) -> None:
            try:
                start.wait()
                items[index] = self.run_graph(graphs[index])
            except BaseException as e:  # reported to the caller below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,), name=f"session_processor_{i}") for i in range(len(graphs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [item for item in items if item is not None]

    @staticmethod
    def output(item: SessionQueueItem, source_node_id: str) -> BaseInvocationOutput:
        """The output of a node of the source graph (the one prepared node made from it)."""
        (prepared,) = item.session.source_prepared_mapping[source_node_id]
        return item.session.results[prepared]

    def saved_image(self, item: SessionQueueItem, source_node_id: str = "l2i") -> SavedImage:
        return self.images.saved[self.output(item, source_node_id).image.image_name]
