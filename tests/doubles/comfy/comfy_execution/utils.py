"""Double of ComfyUI's comfy_execution/utils.py: the context of the node being executed (its prompt id)."""
import contextvars
from typing import NamedTuple, Optional


class ExecutionContext(NamedTuple):
    prompt_id: str
    node_id: str
    list_index: Optional[int]


current_executing_context = contextvars.ContextVar("current_executing_context", default=None)


def get_executing_context():
    return current_executing_context.get(None)


class CurrentNodeContext:
    def __init__(self, prompt_id, node_id, list_index=None):
        self.context = ExecutionContext(prompt_id, node_id, list_index)
        self.token = None

    def __enter__(self):
        self.token = current_executing_context.set(self.context)
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        current_executing_context.reset(self.token)
