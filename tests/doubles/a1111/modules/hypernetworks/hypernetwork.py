"""Double of modules/hypernetworks/hypernetwork.py: the parts attention forwards use.

A hypernetwork holds ``layers``: context width -> (module for k, module for v). ``apply_hypernetworks``
runs every loaded one in turn on the context, choosing layers by ``context_k.shape[2]``.
"""

import torch

from modules import devices, shared


class Hypernetwork:
    def __init__(self, name="test", layers=None):
        self.name = name
        self.layers = dict(layers or {})


def apply_single_hypernetwork(hypernetwork, context_k, context_v, layer=None):
    chosen = (hypernetwork.layers if hypernetwork is not None else {}).get(context_k.shape[2], None)
    if chosen is None:
        return context_k, context_v
    if layer is not None:
        layer.hyper_k = chosen[0]
        layer.hyper_v = chosen[1]
    context_k = devices.cond_cast_unet(chosen[0](devices.cond_cast_float(context_k)))
    context_v = devices.cond_cast_unet(chosen[1](devices.cond_cast_float(context_v)))
    return context_k, context_v


def apply_hypernetworks(hypernetworks, context, layer=None):
    """(ctx_k, ctx_v); the identity when ``hypernetworks`` is empty."""
    context_k = context
    context_v = context
    for hypernetwork in hypernetworks:
        context_k, context_v = apply_single_hypernetwork(hypernetwork, context_k, context_v, layer)
    return context_k, context_v


def attention_CrossAttention_forward(self, x, context=None, mask=None, **kwargs):
    """The unoptimised einsum forward that A1111 restores on undo (passes ``layer=self``)."""
    h = self.heads
    q = self.to_q(x)
    context = x if context is None else context
    context_k, context_v = apply_hypernetworks(shared.loaded_hypernetworks, context, self)
    k = self.to_k(context_k)
    v = self.to_v(context_v)
    b, n, inner = q.shape
    d = inner // h
    q, k, v = (t.reshape(b, -1, h, d).permute(0, 2, 1, 3).reshape(b * h, -1, d) for t in (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
    if mask is not None:
        keep = mask.reshape(b, -1).repeat_interleave(h, dim=0)[:, None, :]
        sim = sim.masked_fill(~keep, -torch.finfo(sim.dtype).max)
    attn = sim.softmax(dim=-1)
    out = torch.einsum("b i j, b j d -> b i d", attn, v)
    out = out.reshape(b, h, -1, d).permute(0, 2, 1, 3).reshape(b, -1, h * d)
    return self.to_out(out)
