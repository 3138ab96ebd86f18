"""Double of ComfyUI's comfy/model_patcher.py: ``ModelPatcher`` with ``model_options``
(``{"transformer_options": {}}``), ``clone()`` (the same model; a deep copy of ``model_options``; wrappers
and callbacks copied per key) and the wrapper registry."""
import copy


class ModelPatcher:
    def __init__(self, model, load_device=None, offload_device=None, size=0, weight_inplace_update=False):
        self.model = model
        self.load_device, self.offload_device = load_device, offload_device
        self.size = size
        self.weight_inplace_update = weight_inplace_update
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}
        self.callbacks = {}
        self.parent = None

    def model_size(self):
        return self.size

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device, self.model_size(),
                           weight_inplace_update=self.weight_inplace_update)
        n.model_options = copy.deepcopy(self.model_options)
        n.parent = self
        for k, c in self.callbacks.items():
            n.callbacks[k] = {k1: list(c1) for k1, c1 in c.items()}
        for k, w in self.wrappers.items():
            n.wrappers[k] = {k1: list(w1) for k1, w1 in w.items()}
        return n

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def add_wrapper(self, wrapper_type, wrapper):
        self.add_wrapper_with_key(wrapper_type, None, wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def get_all_wrappers(self, wrapper_type):
        found = []
        for wrappers in self.wrappers.get(wrapper_type, {}).values():
            found.extend(wrappers)
        return found

    def set_model_optimized_attention(self, optimized_attention):
        """Newer ComfyUI (the Model Attention Backend node): an override that runs ``optimized_attention``
        with the call's arguments and leaves the ``func`` it is handed unused."""
        def optimized_attention_override(_, *args, **kwargs):
            return optimized_attention(*args, **kwargs)
        self.model_options["transformer_options"]["optimized_attention_override"] = optimized_attention_override

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)
