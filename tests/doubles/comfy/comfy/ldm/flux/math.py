"""Double of ComfyUI's comfy/ldm/flux/math.py: imports ``optimized_attention`` by name;
``attention(q, k, v, pe, mask=None, transformer_options={})`` applies RoPE and calls it with
``skip_reshape=True, mask=mask, transformer_options=transformer_options``."""
from comfy.ldm.modules.attention import optimized_attention


def attention(q, k, v, pe, mask=None, transformer_options={}):
    if pe is not None:
        q_shape, k_shape = q.shape, k.shape
        q = q.to(dtype=pe.dtype).reshape(*q.shape[:-1], -1, 1, 2)
        k = k.to(dtype=pe.dtype).reshape(*k.shape[:-1], -1, 1, 2)
        q = (pe[..., 0] * q[..., 0] + pe[..., 1] * q[..., 1]).reshape(*q_shape).type_as(v)
        k = (pe[..., 0] * k[..., 0] + pe[..., 1] * k[..., 1]).reshape(*k_shape).type_as(v)
    heads = q.shape[1]
    return optimized_attention(q, k, v, heads, skip_reshape=True, mask=mask, transformer_options=transformer_options)
