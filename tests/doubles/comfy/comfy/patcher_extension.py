"""Double of ComfyUI's comfy/patcher_extension.py: wrapper types, the wrapper chain (each wrapper is
called as ``wrapper(executor, *args, **kwargs)`` and calls ``executor(*args, **kwargs)`` to go on), and
the nested-dict merge the sampler uses to put a patcher's wrappers into its transformer options."""


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    PREPARE_SAMPLING = "prepare_sampling"
    SAMPLER_SAMPLE = "sampler_sample"
    PREDICT_NOISE = "predict_noise"
    CALC_COND_BATCH = "calc_cond_batch"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"


class CallbacksMP:
    ON_CLEANUP = "on_cleanup"
    ON_PRE_RUN = "on_pre_run"


def get_all_wrappers(wrapper_type, transformer_options, is_model_options=False):
    if is_model_options:
        transformer_options = transformer_options.get("transformer_options", {})
    found = []
    for wrappers in transformer_options.get("wrappers", {}).get(wrapper_type, {}).values():
        found.extend(wrappers)
    return found


class WrapperExecutor:
    def __init__(self, original, class_obj, wrappers, idx):
        self.original, self.class_obj, self.wrappers, self.idx = original, class_obj, list(wrappers), idx
        self.is_last = idx == len(wrappers)

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.is_last:
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    @classmethod
    def new_executor(cls, original, wrappers, idx=0):
        return cls(original, None, wrappers, idx)

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers, idx=0):
        return cls(original, class_obj, wrappers, idx)


def copy_nested_dicts(input_dict):
    out = input_dict.copy()
    for key, value in input_dict.items():
        if isinstance(value, dict):
            out[key] = copy_nested_dicts(value)
    return out


def merge_nested_dicts(dict1, dict2, copy_dict1=True):
    merged = copy_nested_dicts(dict1) if copy_dict1 else dict1
    for key, value in dict2.items():
        if isinstance(value, dict):
            merged[key] = merge_nested_dicts(merged.setdefault(key, {}), value)
        elif isinstance(value, list):
            merged.setdefault(key, []).extend(value)
        else:
            merged[key] = value
    return merged
