"""Which configuration each node of a session runs under.

The user says it with the Attention backend node, or for every session with ``ATTN_INVOKE_ROUTE``:

* an Attention backend node whose outputs are connected applies to the nodes that get their model
  through it: following the session's graph from its ``unet``, ``transformer``, ``wan_transformer``
  and ``vae`` outputs, through nodes that pass a model on (a LoRA loader), to the nodes that use it
  (the denoise node, the VAE decode);
* one whose outputs are connected to nothing applies to the whole graph (a graph with two such nodes is
  refused when its first node runs: neither could be said to apply);
* a node neither reaches runs under ``ATTN_INVOKE_ROUTE`` (``auto`` or a chain of backend ids; empty,
  ``0`` or ``off``: not routed, which is the default), for the users of InvokeAI's canvas and
  generate tabs, which build their graphs themselves.

A node is routed in the role its model inputs say (a UNet: ``unet``; a transformer: ``dit``; only a
VAE: ``vae``); a node without one (a text encoder, an image filter) is never routed.
``ATTN_INVOKE_SCHEDULE`` is the default schedule: that of the environment's route and of every node
whose schedule is empty; ``ATTN_INVOKE_SPARSE`` the default sparse attention in the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import lib_attn
from lib_attn.config import GUARD_MODES, TUNE_MODES

from host_attn.node_options import AUTO, config_for, parse_chain

ENV_ROUTE = "ATTN_INVOKE_ROUTE"
ENV_SCHEDULE = "ATTN_INVOKE_SCHEDULE"
ENV_SPARSE = "ATTN_INVOKE_SPARSE"
OFF = ("", "0", "off", "false", "no")
ON = ("auto", "on", "1", "true", "yes")
#: The outputs through which a node passes a model on.
MODEL_OUTPUTS = ("unet", "transformer", "wan_transformer", "vae")
#: A node's role from the classes of its model inputs, by name: InvokeAI's own field classes.
ROLE_OF_FIELD = {"UNetField": "unet", "TransformerField": "dit", "WanTransformerField": "dit", "VAEField": "vae"}
DENOISERS = ("unet", "dit")


@dataclass(frozen=True)
class Choice:
    """``config``: ``lib_attn.use``'s arguments; ``said_by``: the node or variable that chose it;
    ``summary``: what the image's metadata records of it."""

    config: dict
    said_by: str
    summary: dict = field(default_factory=dict)


def choice(backend: str = AUTO, chain: str = "", vae_chain: str = "", guard: str = GUARD_MODES[0],
           schedule: str = "", strict: bool = False, fp32: str = AUTO, tune: str = TUNE_MODES[0],
           said_by: str = "", sparse: str = "") -> Choice:
    """The choice an Attention backend node's fields make; ValueError names a bad value and the valid ones."""
    config = config_for(DENOISERS, backend, chain, strict, fp32, tune, guard, schedule, sparse)
    denoiser = parse_chain(backend, chain)
    try:
        vae = parse_chain(AUTO, vae_chain)
    except ValueError as exc:
        raise ValueError(f"VAE chain: {exc}") from None
    if vae:
        config["preference"] = {"unet": denoiser, "dit": denoiser, "vae": vae}
    summary = {"backend": ",".join(denoiser) if denoiser else AUTO, "vae": ",".join(vae) if vae else AUTO,
               "guard": guard, "schedule": (schedule or "").strip() or None, "strict": bool(strict),
               "sparse": config["sparse"].text if config.get("sparse") else (sparse or "").strip() or None,
               "said_by": said_by}
    return Choice(config, said_by, summary)


def from_environment(environ=os.environ) -> Choice | None:
    """``ATTN_INVOKE_ROUTE``'s choice, or None when it asks for none; ValueError names an unknown id."""
    value = environ.get(ENV_ROUTE, "").strip()
    if value.lower() in OFF:
        return None
    chain = "" if value.lower() in ON else value
    try:
        parse_chain(AUTO, chain)
    except ValueError as exc:
        raise ValueError(f"{ENV_ROUTE}={value!r}: {exc}") from None
    return choice(chain=chain, said_by=f"{ENV_ROUTE}={value}")


def default_schedule(environ=os.environ):
    """Put ``ATTN_INVOKE_SCHEDULE`` in force (ValueError, naming the rule, when it does not parse)."""
    return _default(environ, ENV_SCHEDULE, "schedule")


def default_sparse(environ=os.environ):
    """Put ``ATTN_INVOKE_SPARSE`` in force (ValueError, naming the value, when it does not parse)."""
    return _default(environ, ENV_SPARSE, "sparse")


def _default(environ, variable: str, field: str):
    text = environ.get(variable, "").strip()
    if text:
        try:
            lib_attn.configure(**{field: text}, hosted=True)
        except ValueError as exc:
            raise ValueError(f"{variable}={text!r}: {exc}") from None
    return getattr(lib_attn.config(), field)


def role_of(invocation) -> str | None:
    """The role a node's attention runs in, from its model inputs; None for a node without one."""
    found = {ROLE_OF_FIELD.get(type(getattr(invocation, name, None)).__name__)
             for name in type(invocation).model_fields}
    for role in ("unet", "dit", "vae"):
        if role in found:
            return role
    return None


class GraphChoices:
    """Which Attention backend node each node of one session's graph runs under, and that node's choice.

    The nodes each one reaches are read from the session's source graph once; the choice is read when a
    node runs, from the Attention backend node as InvokeAI prepared it: values connected to its inputs
    (a String node giving ``chain``) are set only on that prepared copy, checked by the node's own
    validators as InvokeAI sets them (a bad one fails the session there, naming the field)."""

    def __init__(self, state, node_type: str, default: Choice | None = None):
        self.state = state
        self.node_type = node_type
        self.by_node: dict = {}  # source id -> the source id of the Attention backend node that reaches it
        self.everywhere = None  # the source id of an Attention backend node connected to nothing
        self.default = default
        graph = getattr(state, "graph", None)
        nodes = getattr(graph, "nodes", None) or {}
        edges = list(getattr(graph, "edges", None) or ())
        unconnected = []
        for node_id, node in nodes.items():
            if node.get_type() != node_type:
                continue
            if not any(e.source.node_id == node_id for e in edges):
                unconnected.append(node_id)
                continue
            for reached in _downstream(node_id, edges):
                self.by_node.setdefault(reached, node_id)
        if len(unconnected) > 1:
            raise ValueError(f"Attention backend nodes {', '.join(sorted(unconnected))} are each connected to nothing, "
                             f"so each would route the whole graph: keep one, or connect each one's outputs to the "
                             f"models it routes")
        self.everywhere = unconnected[0] if unconnected else None

    def __bool__(self):
        return bool(self.by_node) or self.everywhere is not None or self.default is not None

    def get(self, source_id: str, prepared_id: str | None = None, state=None) -> Choice | None:
        """The choice the node ``prepared_id`` (prepared from ``source_id``) runs under, or None; ``state``:
        the session's execution state now (``prepared``)."""
        said_by = self.by_node.get(source_id, self.everywhere)
        if said_by is None:
            return self.default
        return self.prepared(said_by, prepared_id, state).choice(said_by)

    def prepared(self, source_id: str, downstream: str | None = None, state=None):
        """The Attention backend node ``source_id`` as it applies to the node ``downstream``: the prepared
        copy that passed the model on to it (it ran before it, with its connected values set); for a node
        connected to no model, the node as typed. ValueError when its values come from other nodes but it
        is connected to no model: InvokeAI may run a routed node before those, so they cannot apply. ``state``:
        the execution state the queue item holds now (the return from a called workflow reads the item
        again, into a new one), else the one the session began with."""
        state = self.state if state is None else state
        execution = getattr(state, "execution_graph", None)
        mapping = getattr(state, "prepared_source_mapping", None) or {}
        if execution is not None and downstream is not None:
            seen, frontier = {downstream}, [downstream]
            while frontier:
                node_id = frontier.pop(0)
                for edge in execution.edges:
                    parent = edge.source.node_id
                    if edge.destination.node_id != node_id or edge.source.field not in MODEL_OUTPUTS or parent in seen:
                        continue
                    if mapping.get(parent) == source_id and parent in state.executed:
                        return execution.nodes[parent]
                    seen.add(parent)
                    frontier.append(parent)
        # Its model inputs hold no value of the configuration: a model connected in leaves it routing the graph.
        connected = sorted({e.destination.field for e in state.graph.edges
                            if e.destination.node_id == source_id and e.destination.field not in MODEL_OUTPUTS})
        if connected:
            raise ValueError(f"Attention backend node {source_id}: {', '.join(connected)} connected from other nodes, "
                             f"while the node is connected to no model; connect its outputs to the models it routes "
                             f"(it then runs before them, with those values), or type the values")
        return state.graph.nodes[source_id]


def _downstream(start: str, edges: list) -> list[str]:
    """The nodes that get a model through ``start``, nearest first."""
    seen, order, frontier = {start}, [], [start]
    while frontier:
        node_id = frontier.pop(0)
        for edge in edges:
            if edge.source.node_id == node_id and edge.source.field in MODEL_OUTPUTS:
                target = edge.destination.node_id
                if target not in seen:
                    seen.add(target)
                    order.append(target)
                    frontier.append(target)
    return order
