"""Double of ``invokeai/app/services/shared/graph.py`` (InvokeAI 6.14.2), without iterate/collect/if nodes.

Kept as the release does it:
- ``Graph``: ``id``, ``nodes`` (node id -> node; a dict node is validated through the registry's
  discriminated union on ``type``, so a bad field raises pydantic's ``ValidationError`` when the graph is
  built), ``edges`` (``Edge(source=EdgeConnection(node_id, field), destination=...)``). ``add_edge`` refuses
  (``InvalidEdgeError``) an edge to or from a missing node or field, a second edge into one input, a cycle, and
  types that cannot connect (the release's ``are_connection_types_compatible``); ``validate_self`` checks the
  same for a whole graph (``NodeNotFoundError``, ``NodeFieldNotFoundError``, ``CyclicalGraphError``, ...).
- ``GraphExecutionState``: ``graph`` (the source graph, validated), ``execution_graph`` (the prepared nodes:
  deep copies of the source nodes with fresh uuid ids, wired to the prepared parents), ``prepared_source_mapping``
  (prepared id -> source id), ``source_prepared_mapping`` (source id -> set of prepared ids), ``results`` (by
  prepared id), ``executed``, ``executed_history``, ``errors``. ``next()`` prepares every node it can at once,
  in topological order, with its typed values only (the release's ``_prepare_until_node_ready``), and sets the
  inputs of the node it returns from its parents' outputs then (a deep copy of each, through validated
  assignment; a value the field refuses raises ``NodeInputError``), ``complete(id, output)``,
  ``set_node_error``, ``is_complete``, ``has_error``.
The release picks among ready nodes by class (``ready_order``); this double takes the first ready one in the
order they were prepared, which is one valid topological order.
"""
from __future__ import annotations

import copy
import uuid
from typing import Any, Optional, TypeVar, get_args, get_origin

from pydantic import BaseModel, Field, GetCoreSchemaHandler, ValidationError, field_validator
from pydantic_core import core_schema

from invokeai.app.invocations.baseinvocation import BaseInvocation, BaseInvocationOutput, InvocationRegistry

T = TypeVar("T")


def uuid_string() -> str:
    return str(uuid.uuid4())


class EdgeConnection(BaseModel):
    node_id: str = Field(description="Node id")
    field: str = Field(description="Field name")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EdgeConnection) and (self.node_id, self.field) == (other.node_id, other.field)

    def __hash__(self) -> int:
        return hash(f"{self.node_id}.{self.field}")


class Edge(BaseModel):
    source: EdgeConnection = Field(description="Where the value comes from")
    destination: EdgeConnection = Field(description="Where the value goes")

    def __str__(self) -> str:
        return f"{self.source.node_id}.{self.source.field} -> {self.destination.node_id}.{self.destination.field}"


class NodeAlreadyInGraphError(ValueError):
    pass


class InvalidEdgeError(ValueError):
    pass


class NodeNotFoundError(ValueError):
    pass


class NodeFieldNotFoundError(ValueError):
    pass


class NodeIdMismatchError(ValueError):
    pass


class CyclicalGraphError(ValueError):
    pass


class NodeInputError(ValueError):
    """A prepared node refused a value that came along an edge (the first refused field is named)."""

    def __init__(self, node: BaseInvocation, e: ValidationError):
        self.original_error = e
        self.node = node
        self.failed_input = ".".join(str(x) for x in e.errors()[0]["loc"])
        super().__init__(f"Node {node.id} has invalid incoming input for {self.failed_input}")


class AnyInvocation(BaseInvocation):
    """Any registered node: validated through the registry's union, discriminated on ``type``."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source_type: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(v: Any) -> Any:
            return InvocationRegistry.get_invocation_typeadapter().validate_python(v)

        return core_schema.no_info_plain_validator_function(validate)


class AnyInvocationOutput(BaseInvocationOutput):
    @classmethod
    def __get_pydantic_core_schema__(cls, source_type: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        def validate(v: Any) -> Any:
            return InvocationRegistry.get_output_typeadapter().validate_python(v)

        return core_schema.no_info_plain_validator_function(validate)


def copydeep(obj: T) -> T:
    if isinstance(obj, BaseModel):
        return obj.model_copy(deep=True)
    return copy.deepcopy(obj)


def get_output_field_type(node: BaseInvocation, field: str) -> Any:
    info = type(node).get_output_annotation().model_fields.get(field)
    return None if info is None else info.annotation


def get_input_field_type(node: BaseInvocation, field: str) -> Any:
    info = type(node).model_fields.get(field)
    return None if info is None else info.annotation


def _is_any(t: Any) -> bool:
    return t == Any or Any in get_args(t)


def are_connection_types_compatible(from_type: Any, to_type: Any) -> bool:
    """The release's rule: equal, Any on either side, one a member of the other's union, int to float,
    int or float to str, a subclass, or a union whose members are all in the other's."""
    if not from_type or not to_type:
        return False
    if from_type == to_type or _is_any(from_type) or _is_any(to_type):
        return True
    if from_type in get_args(to_type) or to_type in get_args(from_type):
        return True
    if from_type is int and to_type is float:
        return True
    if from_type in (int, float) and to_type is str:
        return True
    if isinstance(from_type, type) and isinstance(to_type, type) and get_origin(from_type) is None \
            and get_origin(to_type) is None:
        try:
            return issubclass(from_type, to_type)
        except TypeError:
            pass
    from_args, to_args = get_args(from_type), get_args(to_type)
    if not from_args:
        return from_type in to_args
    return all(arg in to_args for arg in from_args)


class Graph(BaseModel):
    id: str = Field(default_factory=uuid_string, description="Graph id")
    nodes: dict[str, AnyInvocation] = Field(default_factory=dict, description="Nodes by id")
    edges: list[Edge] = Field(default_factory=list, description="Connections between node fields")

    def add_node(self, node: BaseInvocation) -> None:
        if node.id in self.nodes:
            raise NodeAlreadyInGraphError()
        self.nodes[node.id] = node

    def get_node(self, node_id: str) -> BaseInvocation:
        if node_id not in self.nodes:
            raise NodeNotFoundError(f"Node {node_id} not found in graph")
        return self.nodes[node_id]

    def has_node(self, node_id: str) -> bool:
        return node_id in self.nodes

    def _get_input_edges(self, node_id: str, field: Optional[str] = None) -> list[Edge]:
        return [e for e in self.edges if e.destination.node_id == node_id
                and (field is None or e.destination.field == field)]

    def _get_output_edges(self, node_id: str, field: Optional[str] = None) -> list[Edge]:
        return [e for e in self.edges if e.source.node_id == node_id and (field is None or e.source.field == field)]

    def _is_acyclic(self, extra: Optional[Edge] = None) -> bool:
        children: dict[str, set[str]] = {n: set() for n in self.nodes}
        for e in self.edges + ([extra] if extra else []):
            children.setdefault(e.source.node_id, set()).add(e.destination.node_id)
        state: dict[str, int] = {}

        def visit(n: str) -> bool:
            if state.get(n) == 1:
                return False
            if state.get(n) == 2:
                return True
            state[n] = 1
            ok = all(visit(c) for c in children.get(n, ()))
            state[n] = 2
            return ok

        return all(visit(n) for n in list(children))

    def add_edge(self, edge: Edge) -> None:
        try:
            source, destination = self.get_node(edge.source.node_id), self.get_node(edge.destination.node_id)
        except NodeNotFoundError:
            raise InvalidEdgeError(f"One or both nodes don't exist ({edge})")
        if self._get_input_edges(edge.destination.node_id, edge.destination.field):
            raise InvalidEdgeError(f"Edge already exists ({edge})")
        if not self._is_acyclic(edge):
            raise InvalidEdgeError(f"Edge creates a cycle in the graph ({edge})")
        from_type = get_output_field_type(source, edge.source.field)
        to_type = get_input_field_type(destination, edge.destination.field)
        if from_type is None:
            raise InvalidEdgeError(f"Source field {edge.source.field} does not exist ({edge})")
        if to_type is None:
            raise InvalidEdgeError(f"Destination field {edge.destination.field} does not exist ({edge})")
        if not are_connection_types_compatible(from_type, to_type):
            raise InvalidEdgeError(f"Field types are incompatible ({edge})")
        if edge not in self.edges:
            self.edges.append(edge)

    def delete_edge(self, edge: Edge) -> None:
        if edge in self.edges:
            self.edges.remove(edge)

    def validate_self(self) -> None:
        for node_id, node in self.nodes.items():
            if node_id != node.id:
                raise NodeIdMismatchError(f"Node ids must match, got {node_id} and {node.id}")
        for e in self.edges:
            for end in (e.source, e.destination):
                if end.node_id not in self.nodes:
                    raise NodeNotFoundError(f"Edge node {end.node_id} does not exist in the graph")
            if get_output_field_type(self.nodes[e.source.node_id], e.source.field) is None:
                raise NodeFieldNotFoundError(
                    f"Edge source field {e.source.field} does not exist in node {e.source.node_id}")
            if e.destination.field not in type(self.nodes[e.destination.node_id]).model_fields:
                raise NodeFieldNotFoundError(
                    f"Edge destination field {e.destination.field} does not exist in node {e.destination.node_id}")
        if not self._is_acyclic():
            raise CyclicalGraphError("Graph contains cycles")
        for e in self.edges:
            if not are_connection_types_compatible(
                    get_output_field_type(self.nodes[e.source.node_id], e.source.field),
                    get_input_field_type(self.nodes[e.destination.node_id], e.destination.field)):
                raise InvalidEdgeError(f"Edge source and target types do not match ({e})")

    def is_valid(self) -> bool:
        try:
            self.validate_self()
            return True
        except (NodeIdMismatchError, NodeNotFoundError, NodeFieldNotFoundError, CyclicalGraphError, InvalidEdgeError):
            return False


class GraphExecutionState(BaseModel):
    id: str = Field(default_factory=uuid_string, description="Session id")
    graph: Graph = Field(description="The source graph")
    execution_graph: Graph = Field(default_factory=Graph, description="The prepared nodes and their edges")
    executed: set[str] = Field(default_factory=set, description="Executed node ids, prepared and source")
    executed_history: list[str] = Field(default_factory=list, description="Source ids in the order they ran")
    results: dict[str, AnyInvocationOutput] = Field(default_factory=dict, description="Outputs by prepared id")
    errors: dict[str, str] = Field(default_factory=dict, description="Errors by prepared id")
    prepared_source_mapping: dict[str, str] = Field(default_factory=dict, description="Prepared id -> source id")
    source_prepared_mapping: dict[str, set[str]] = Field(default_factory=dict,
                                                         description="Source id -> prepared ids")

    @field_validator("graph")
    @classmethod
    def graph_is_valid(cls, v: Graph) -> Graph:
        v.validate_self()
        return v

    def _preparable_source(self) -> Optional[str]:
        for node_id in self.graph.nodes:
            if node_id in self.source_prepared_mapping:
                continue
            parents = {e.source.node_id for e in self.graph._get_input_edges(node_id)}
            if all(p in self.source_prepared_mapping for p in parents):
                return node_id
        return None

    def _ready_prepared(self) -> Optional[BaseInvocation]:
        for node_id, node in self.execution_graph.nodes.items():
            if node_id in self.executed or node_id in self.errors:
                continue
            if all(e.source.node_id in self.executed for e in self.execution_graph._get_input_edges(node_id)):
                return node
        return None

    def _prepare(self, source_id: str) -> BaseInvocation:
        node = self.graph.nodes[source_id].model_copy(deep=True)
        node.id = uuid_string()
        self.execution_graph.nodes[node.id] = node
        self.prepared_source_mapping[node.id] = source_id
        self.source_prepared_mapping[source_id] = {node.id}
        for e in self.graph._get_input_edges(source_id):
            (parent,) = self.source_prepared_mapping[e.source.node_id]
            self.execution_graph.edges.append(Edge(source=EdgeConnection(node_id=parent, field=e.source.field),
                                                   destination=EdgeConnection(node_id=node.id,
                                                                              field=e.destination.field)))
        return node

    def next(self) -> Optional[BaseInvocation]:
        """The next node to run, with its inputs set now (from its parents' outputs); None when none is left.
        As the release, every node that can be is prepared at once (a copy with its typed values only), and
        the values of its connections are set when it is returned to run."""
        node = self._ready_prepared()
        if node is None:
            while (source_id := self._preparable_source()) is not None:
                self._prepare(source_id)
            node = self._ready_prepared()
        if node is None:
            return None
        try:
            for e in self.execution_graph._get_input_edges(node.id):
                setattr(node, e.destination.field, copydeep(getattr(self.results[e.source.node_id], e.source.field)))
        except ValidationError as e:
            raise NodeInputError(node, e)
        return node

    def complete(self, node_id: str, output: BaseInvocationOutput) -> None:
        if node_id not in self.execution_graph.nodes:
            return
        self.results[node_id] = output
        self.executed.add(node_id)
        source_id = self.prepared_source_mapping[node_id]
        if all(p in self.executed for p in self.source_prepared_mapping[source_id]):
            self.executed.add(source_id)
            self.executed_history.append(source_id)

    def set_node_error(self, node_id: str, error: str) -> None:
        self.errors[node_id] = error

    def is_complete(self) -> bool:
        return self.has_error() or all(n in self.executed for n in self.graph.nodes)

    def has_error(self) -> bool:
        return len(self.errors) > 0
