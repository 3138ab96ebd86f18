"""Which configuration each node of a session runs under.

The user says it with the Attention backend node, or for every session with ``ATTN_INVOKE_ROUTE``:

* an Attention backend node whose outputs are connected applies to the nodes that get their model
  through it: following the session's graph from its ``unet``, ``transformer``, ``wan_transformer``
  and ``vae`` outputs, through nodes that pass a model on (a LoRA loader), to the nodes that use it
  (the denoise node, the VAE decode);
* one whose outputs are connected to nothing applies to the whole graph;
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
            lib_attn.configure(**{field: text})
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
    """The choice for each node of one session's graph (by the id of the node it was prepared from)."""

    def __init__(self, graph, node_type: str, default: Choice | None = None):
        self.node_type = node_type
        self.by_node: dict = {}
        self.everywhere = default
        nodes = getattr(graph, "nodes", None) or {}
        edges = list(getattr(graph, "edges", None) or ())
        for node_id, node in nodes.items():
            if node.get_type() != node_type:
                continue
            made = node.choice()
            outgoing = [e for e in edges if e.source.node_id == node_id]
            if not outgoing:
                self.everywhere = made
                continue
            for reached in _downstream(node_id, edges):
                self.by_node.setdefault(reached, made)

    def __bool__(self):
        return bool(self.by_node) or self.everywhere is not None

    def get(self, node_id: str) -> Choice | None:
        return self.by_node.get(node_id, self.everywhere)


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
