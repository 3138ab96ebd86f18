"""Double of the override ComfyUI's Model Sparse Attention node puts on a model
(Comfy-Org/ComfyUI comfy_extras/nodes_sparse_attention.py, newer than 0.19.3), loaded as ComfyUI loads
a file of ``comfy_extras`` (a module named by its path less ``.py``).

Facts kept: ``make_attention_override(patch, previous)`` returns a closure whose qualified name is
``make_attention_override.<locals>.override``, called as ComfyUI calls an override, ``(func, q, k, v,
heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)``. A call
without a mask whose queries and keys have the same shape and at least ``patch.min_tokens`` tokens runs on
the node's own kernel (comfy_kitchen's on CUDA; ComfyUI's PyTorch attention here, counted in
``patch.taken``); every other call is handed to ``previous(func, …)``, the override that was there
before, or to ``func``. ``install_override(patch, transformer_options)`` puts a new one on top of
whatever override is there, unless that one is its own (ComfyUI runs it again at every step).
"""
from comfy.ldm.modules import attention


class SparseAttnPatch:
    def __init__(self, min_tokens=1):
        self.min_tokens = min_tokens
        self.taken = []
        self.installed = set()


def make_attention_override(patch, previous):
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        keywords = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        if mask is None and q.shape == k.shape and tokens >= patch.min_tokens:
            patch.taken.append(tuple(q.shape))
            return attention.attention_pytorch(q, k, v, heads, **keywords)
        if previous is None:
            return func(q, k, v, heads, **keywords)
        return previous(func, q, k, v, heads, **keywords)
    return override


def install_override(patch, transformer_options):
    current = transformer_options.get("optimized_attention_override")
    if current not in patch.installed:
        override = make_attention_override(patch, current)
        patch.installed.add(override)
        transformer_options["optimized_attention_override"] = override
