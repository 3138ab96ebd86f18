"""A1111's class-level forwards for ldm/sgm ``CrossAttention`` and ``AttnBlock``, routed through ``lib_attn``.

Nothing here is chosen at patch time: every call asks the engine, so a backend change between
generations needs no re-patching. Host modules are imported inside the forwards, at call time,
because the webui's ``modules`` package is only there when a webui runs. The function-convention
hosts (Forge and its lines, ComfyUI) are served by ``host_attn.convention``.
"""
from __future__ import annotations

from host_attn.convention import heads_attention, spatial_attention

from ..settings.flags import fp32_for_upcast


# --- A1111: class-level forwards for ldm/sgm CrossAttention and AttnBlock --------------------------------

def cross_attention_forward(self, x, context=None, mask=None, **kwargs):
    """``CrossAttention.forward`` for ldm and sgm, doing what A1111's built-in ``sdp`` forward does.

    ``**kwargs`` absorbs sgm's ``additional_tokens`` and ``n_times_crossframe_attn_in_self``, which the
    built-ins ignore too. ``mask`` keeps ldm's meaning, a ``(b, ...)`` bool mask over the context tokens.
    """
    from modules import shared
    from modules.hypernetworks import hypernetwork

    q = self.to_q(x)
    context = x if context is None else context
    context_k, context_v = hypernetwork.apply_hypernetworks(shared.loaded_hypernetworks, context)
    k = self.to_k(context_k)
    v = self.to_v(context_v)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], -1)[:, None, None, :]
    upcast = bool(getattr(shared.opts, "upcast_attn", False))
    out = heads_attention(q, k, v, self.heads, mask, role="unet", upcast=upcast, fp32_rule=fp32_for_upcast)
    return self.to_out(out)


def attnblock_forward(self, x, **kwargs):
    """``AttnBlock.forward`` (ldm, sgm) and ldm's ``MemoryEfficientAttnBlock.forward``: norm, q/k/v 1x1
    convs, single-head attention over pixels, ``proj_out``, residual. ``**kwargs`` matches sgm's signature.
    """
    from modules import shared

    h = self.norm(x)
    out = spatial_attention(self.q(h), self.k(h), self.v(h), upcast=bool(getattr(shared.opts, "upcast_attn", False)),
                            fp32_rule=fp32_for_upcast)
    return x + self.proj_out(out)
