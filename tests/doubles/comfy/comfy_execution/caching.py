"""Double of the output cache's keys in ComfyUI's ``comfy_execution/caching.py`` (ComfyUI 0.19.3,
``xmarre/ComfyUI`` 6d4f9e86; the same rule as 0.8.0), with ``IsChangedCache`` of its ``execution.py``.

As there: a node's key (``CacheKeySetInputSignature.get_node_signature``) is its immediate signature
followed by those of all its ancestors, in the order met walking its inputs by sorted name, depth first,
each ancestor once. An immediate signature is the class type, the node's ``IS_CHANGED`` result (False
for a class without one; called with the node's constant inputs), the node id when the class is
``NOT_IDEMPOTENT`` or takes ``UNIQUE_ID``, and each input by sorted name: a link as
``("ANCESTOR", index of its node in that order, output slot)``, a constant as its hashable form. A value
that has no hashable form makes the key ``Unhashable`` (a fresh object, never found: the node runs).
Kept synchronous here (ComfyUI awaits the ``IS_CHANGED`` calls); ``to_hashable`` turns lists and tuples
into tuples and dicts into sorted item tuples, without ComfyUI's depth and size budgets.
"""
import nodes

_PRIMITIVES = (int, float, str, bool, bytes, type(None))


class Unhashable:
    """A value with no hashable form: every instance is a key of its own."""


def is_link(value):
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def to_hashable(obj):
    if type(obj) in _PRIMITIVES or type(obj) is Unhashable:
        return obj
    if isinstance(obj, (list, tuple)):
        items = tuple(to_hashable(i) for i in obj)
        return Unhashable() if any(type(i) is Unhashable for i in items) else ("list", items)
    if isinstance(obj, dict):
        items = tuple(sorted(((k, to_hashable(v)) for k, v in obj.items()), key=lambda kv: repr(kv[0])))
        return Unhashable() if any(type(v) is Unhashable for _, v in items) else ("dict", items)
    return Unhashable()


class DynamicPrompt:
    """The prompt as the executor sees it: node id -> {"class_type", "inputs"}."""

    def __init__(self, prompt):
        self.prompt = prompt

    def has_node(self, node_id):
        return node_id in self.prompt

    def get_node(self, node_id):
        return self.prompt[node_id]


class IsChangedCache:
    def __init__(self, dynprompt):
        self.dynprompt = dynprompt
        self.is_changed = {}

    def get(self, node_id):
        if node_id not in self.is_changed:
            node = self.dynprompt.get_node(node_id)
            class_def = nodes.NODE_CLASS_MAPPINGS[node["class_type"]]
            if not hasattr(class_def, "IS_CHANGED"):
                self.is_changed[node_id] = False
            else:
                constants = {k: v for k, v in node["inputs"].items() if not is_link(v)}
                try:
                    self.is_changed[node_id] = [class_def.IS_CHANGED(**constants)]
                except Exception:
                    self.is_changed[node_id] = float("NaN")
        return self.is_changed[node_id]


class CacheKeySetInputSignature:
    def __init__(self, dynprompt, node_ids, is_changed_cache):
        self.dynprompt = dynprompt
        self.is_changed_cache = is_changed_cache
        self.keys = {}
        self.add_keys(node_ids)

    def add_keys(self, node_ids):
        for node_id in node_ids:
            if node_id not in self.keys and self.dynprompt.has_node(node_id):
                self.keys[node_id] = self.get_node_signature(self.dynprompt, node_id)

    def get_data_key(self, node_id):
        return self.keys.get(node_id)

    def get_node_signature(self, dynprompt, node_id):
        ancestors, order = self.get_ordered_ancestry(dynprompt, node_id)
        signature = []
        for one in (node_id, *ancestors):
            immediate = self.get_immediate_node_signature(dynprompt, one, order)
            if type(immediate) is Unhashable:
                return immediate
            signature.append(immediate)
        return tuple(signature)

    def get_immediate_node_signature(self, dynprompt, node_id, ancestor_order_mapping):
        if not dynprompt.has_node(node_id):
            return Unhashable()
        node = dynprompt.get_node(node_id)
        class_type = node["class_type"]
        class_def = nodes.NODE_CLASS_MAPPINGS[class_type]
        is_changed = to_hashable(self.is_changed_cache.get(node_id))
        if type(is_changed) is Unhashable:
            return is_changed
        signature = [class_type, is_changed]
        hidden = class_def.INPUT_TYPES().get("hidden", {}).values()
        if getattr(class_def, "NOT_IDEMPOTENT", False) or "UNIQUE_ID" in hidden:
            signature.append(node_id)
        inputs = node["inputs"]
        for key in sorted(inputs):
            if is_link(inputs[key]):
                ancestor_id, socket = inputs[key]
                signature.append((key, ("ANCESTOR", ancestor_order_mapping[ancestor_id], socket)))
            else:
                value = to_hashable(inputs[key])
                if type(value) is Unhashable:
                    return value
                signature.append((key, value))
        return tuple(signature)

    def get_ordered_ancestry(self, dynprompt, node_id):
        ancestors, order = [], {}
        self._ancestry(dynprompt, node_id, ancestors, order)
        return ancestors, order

    def _ancestry(self, dynprompt, node_id, ancestors, order):
        if not dynprompt.has_node(node_id):
            return
        inputs = dynprompt.get_node(node_id)["inputs"]
        for key in sorted(inputs):
            if is_link(inputs[key]) and inputs[key][0] not in order:
                ancestors.append(inputs[key][0])
                order[inputs[key][0]] = len(ancestors) - 1
                self._ancestry(dynprompt, inputs[key][0], ancestors, order)
