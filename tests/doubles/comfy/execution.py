"""Double of the node checks and calls of ComfyUI's execution.py, for one node at a time.

``validate`` does what ``validate_inputs`` does with a node's own values: a combo input's value must be
in its list ("Value not in list", the list shown up to 20 entries) unless the node's ``VALIDATE_INPUTS``
takes that input, and ``VALIDATE_INPUTS`` is called with the inputs it names; a result other than True
is reported once for every input it names ("Custom validation failed for node", each error naming
that input). ``execute`` runs ``FUNCTION`` inside the node's execution context (its prompt id), with
``PromptServer.instance.client_id`` set to the client that queued the prompt (the page sends its own
with every prompt; an API script may send none, then it is None), as ``PromptExecutor.execute`` sets
it for the whole prompt; a node's exception fails the prompt with that exception. ``PromptExecutor``
runs whole prompts with ComfyUI's output cache between them, as main.py's prompt worker does.
"""
import inspect
from types import SimpleNamespace
from typing import NamedTuple

from comfy_execution.utils import CurrentNodeContext


def validate(node_cls, inputs):
    """(True, []) or (False, errors) as ComfyUI reports them."""
    errors = []
    check = getattr(node_cls, "VALIDATE_INPUTS", None)
    names = inspect.getfullargspec(check).args if check is not None else []
    types = node_cls.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, info in types.get(section, {}).items():
            if name not in inputs:
                if section == "required":
                    errors.append({"type": "required_input_missing", "details": name})
                continue
            if name not in names and isinstance(info[0], list) and inputs[name] not in info[0]:
                listed = f"(list of length {len(info[0])})" if len(info[0]) > 20 else str(info[0])
                errors.append({"type": "value_not_in_list", "message": "Value not in list",
                               "details": f"{name}: '{inputs[name]}' not in {listed}",
                               "extra_info": {"input_name": name, "received_value": inputs[name]}})
    if check is not None:
        given = {n: inputs[n] for n in names if n in inputs}
        result = check(**given)
        if result is not True:
            for name in given:
                details = name if result is False else f"{name} - {result}"
                errors.append({"type": "custom_validation_failed", "message": "Custom validation failed for node",
                               "details": details, "extra_info": {"input_name": name}})
    return (not errors), errors


def execute(node_cls, inputs, prompt_id="prompt-1", node_id="1", client_id="client-1"):
    """The node's outputs (its ``FUNCTION``'s return value), run as node ``node_id`` of ``prompt_id``,
    which ``client_id`` queued."""
    from server import PromptServer
    if PromptServer.instance is not None:
        PromptServer.instance.client_id = client_id
    with CurrentNodeContext(prompt_id, node_id):
        return getattr(node_cls(), node_cls.FUNCTION)(**inputs)


def run_prompt(prompt, outputs_cache, prompt_id="prompt-1", client_id="client-1"):
    """Runs a whole prompt (node id -> {"class_type", "inputs"}; a linked input is ``[node id, output slot]``)
    as ComfyUI's executor does with its output cache: each node's key from ``comfy_execution.caching``, a
    node whose key ``outputs_cache`` holds is not run and gives the stored outputs, the others run (their
    parents first) and are stored. Returns ({node id: outputs}, [the ids of the nodes that ran, in order])."""
    import nodes
    from comfy_execution.caching import CacheKeySetInputSignature, DynamicPrompt, IsChangedCache, is_link

    dynprompt = DynamicPrompt(prompt)
    keys = CacheKeySetInputSignature(dynprompt, list(prompt), IsChangedCache(dynprompt))
    outputs, ran = {}, []

    def run(node_id):
        if node_id in outputs:
            return outputs[node_id]
        key = keys.get_data_key(node_id)
        if key in outputs_cache:
            outputs[node_id] = outputs_cache[key]
            return outputs[node_id]
        node = prompt[node_id]
        inputs = {name: run(value[0])[value[1]] if is_link(value) else value for name, value in node["inputs"].items()}
        outputs[node_id] = execute(nodes.NODE_CLASS_MAPPINGS[node["class_type"]], inputs, prompt_id, node_id,
                                   client_id)
        ran.append(node_id)
        outputs_cache[key] = outputs[node_id]
        return outputs[node_id]

    for node_id in prompt:
        run(node_id)
    return outputs, ran


class CacheEntry(NamedTuple):
    ui: dict
    outputs: list


class OutputCache:
    """``caches.outputs`` as ComfyUI 0.19.3's executor leaves it after a prompt: ``get_local(node id)`` gives the
    ``CacheEntry`` stored under that node's key in the prompt that ran last (``get`` is a coroutine there)."""

    def __init__(self):
        self.store, self.keys = {}, {}

    def get_local(self, node_id):
        key = self.keys.get(node_id)
        return self.store.get(key) if key is not None else None

    async def get(self, node_id):
        return self.get_local(node_id)


class PromptExecutor:
    """What main.py's prompt worker calls for each prompt: ``execute(prompt, prompt_id, extra_data,
    execute_outputs)``, synchronous (0.19.3 runs its ``execute_async`` inside), setting the server's client id
    from ``extra_data`` first. Nodes run as ``run_prompt`` runs them; the cache keeps each node's outputs as a
    ``CacheEntry`` (an output node's ``result``), as ComfyUI's does."""

    def __init__(self, server):
        self.server = server
        self.caches = SimpleNamespace(outputs=OutputCache())
        self.ran = []

    def execute(self, prompt, prompt_id, extra_data={}, execute_outputs=[]):
        from comfy_execution.caching import CacheKeySetInputSignature, DynamicPrompt, IsChangedCache

        self.server.client_id = extra_data.get("client_id")
        self.server.last_prompt_id = prompt_id
        cache = self.caches.outputs
        keys = CacheKeySetInputSignature(DynamicPrompt(prompt), list(prompt), IsChangedCache(DynamicPrompt(prompt)))
        cache.keys = {node_id: keys.get_data_key(node_id) for node_id in prompt}
        held = {key: entry.outputs for key, entry in cache.store.items()}
        _, self.ran = run_prompt(prompt, held, prompt_id, self.server.client_id)
        for key, outputs in held.items():
            if key not in cache.store:
                result = outputs.get("result", ()) if isinstance(outputs, dict) else outputs
                cache.store[key] = CacheEntry(ui={}, outputs=list(result))
