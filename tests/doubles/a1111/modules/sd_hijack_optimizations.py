"""Double of modules/sd_hijack_optimizations.py (A1111 1.10.1), from host-contract A1. The sliced and
sub-quadratic built-ins share one unsliced einsum forward here: only their names, flags and priorities matter.

``SdOptimization``, the built-in optimizers with their real names, flags and priorities, and the
reference forwards ``scaled_dot_product_attention_forward`` / ``sdp_attnblock_forward`` that parity
tests compare against. Forge mode replaces this file with an empty one.
"""
from __future__ import annotations

import ldm.modules.attention
import ldm.modules.diffusionmodules.model
import sgm.modules.attention
import sgm.modules.diffusionmodules.model
import torch
from torch import einsum

from ldm.util import default
from modules import shared
from modules.hypernetworks import hypernetwork

diffusionmodules_model_AttnBlock_forward = ldm.modules.diffusionmodules.model.AttnBlock.forward
sgm_diffusionmodules_model_AttnBlock_forward = sgm.modules.diffusionmodules.model.AttnBlock.forward


class SdOptimization:
    name: str = None
    label: str | None = None
    cmd_opt: str | None = None
    priority: int = 0

    def title(self):
        if self.label is None:
            return self.name
        return f"{self.name} - {self.label}"

    def is_available(self):
        return True

    def apply(self):
        pass

    def undo(self):
        ldm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = diffusionmodules_model_AttnBlock_forward
        sgm.modules.attention.CrossAttention.forward = hypernetwork.attention_CrossAttention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = sgm_diffusionmodules_model_AttnBlock_forward


class SdOptimizationXformers(SdOptimization):
    name = "xformers"
    cmd_opt = "xformers"
    priority = 100

    def is_available(self):
        return shared.cmd_opts.force_enable_xformers or (
            shared.xformers_available and torch.cuda.is_available()
            and (6, 0) <= torch.cuda.get_device_capability(shared.device) <= (9, 0))

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = scaled_dot_product_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = sdp_attnblock_forward
        sgm.modules.attention.CrossAttention.forward = scaled_dot_product_attention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = sdp_attnblock_forward


class SdOptimizationSdpNoMem(SdOptimization):
    name = "sdp-no-mem"
    label = "scaled dot product without memory efficient attention"
    cmd_opt = "opt_sdp_no_mem_attention"
    priority = 80

    def is_available(self):
        return hasattr(torch.nn.functional, "scaled_dot_product_attention") and callable(
            torch.nn.functional.scaled_dot_product_attention)

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = scaled_dot_product_no_mem_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = sdp_no_mem_attnblock_forward
        sgm.modules.attention.CrossAttention.forward = scaled_dot_product_no_mem_attention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = sdp_no_mem_attnblock_forward


class SdOptimizationSdp(SdOptimizationSdpNoMem):
    name = "sdp"
    label = "scaled dot product"
    cmd_opt = "opt_sdp_attention"
    priority = 70

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = scaled_dot_product_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = sdp_attnblock_forward
        sgm.modules.attention.CrossAttention.forward = scaled_dot_product_attention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = sdp_attnblock_forward


class SdOptimizationSubQuad(SdOptimization):
    name = "sub-quadratic"
    cmd_opt = "opt_sub_quad_attention"

    @property
    def priority(self):
        return 1000 if shared.device.type == "mps" else 10

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = cross_attention_attnblock_forward
        sgm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = cross_attention_attnblock_forward


class SdOptimizationV1(SdOptimization):
    name = "V1"
    label = "original v1"
    cmd_opt = "opt_split_attention_v1"
    priority = 10

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        sgm.modules.attention.CrossAttention.forward = split_cross_attention_forward


class SdOptimizationInvokeAI(SdOptimization):
    name = "InvokeAI"
    cmd_opt = "opt_split_attention_invokeai"

    @property
    def priority(self):
        return 1000 if shared.device.type not in ("mps", "cuda") else 10

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        sgm.modules.attention.CrossAttention.forward = split_cross_attention_forward


class SdOptimizationDoggettx(SdOptimization):
    name = "Doggettx"
    cmd_opt = "opt_split_attention"
    priority = 90

    def apply(self):
        ldm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        ldm.modules.diffusionmodules.model.AttnBlock.forward = cross_attention_attnblock_forward
        sgm.modules.attention.CrossAttention.forward = split_cross_attention_forward
        sgm.modules.diffusionmodules.model.AttnBlock.forward = cross_attention_attnblock_forward


def list_optimizers(res):
    res.extend([
        SdOptimizationXformers(),
        SdOptimizationSdpNoMem(),
        SdOptimizationSdp(),
        SdOptimizationSubQuad(),
        SdOptimizationV1(),
        SdOptimizationInvokeAI(),
        SdOptimizationDoggettx(),
    ])


def get_available_vram():
    if shared.device.type == "cuda":
        stats = torch.cuda.memory_stats(shared.device)
        mem_active = stats["active_bytes.all.current"]
        mem_reserved = stats["reserved_bytes.all.current"]
        mem_free_cuda, _ = torch.cuda.mem_get_info(torch.cuda.current_device())
        return mem_free_cuda + (mem_reserved - mem_active)
    return 16 * 1024 ** 3


def _preamble(self, x, context):
    q = self.to_q(x)
    context = default(context, x)
    context_k, context_v = hypernetwork.apply_hypernetworks(shared.loaded_hypernetworks, context)
    return q, self.to_k(context_k), self.to_v(context_v)


def split_cross_attention_forward(self, x, context=None, mask=None, **kwargs):
    """Doggettx: einsum attention (the real one slices along the query axis by free VRAM)."""
    h = self.heads
    q_in, k_in, v_in = _preamble(self, x, context)
    dtype = q_in.dtype
    if shared.opts.upcast_attn:
        q_in, k_in, v_in = q_in.float(), k_in.float(), v_in.float()
    b, n, inner = q_in.shape
    d = inner // h
    q, k, v = (t.reshape(b, -1, h, d).permute(0, 2, 1, 3).reshape(b * h, -1, d) for t in (q_in, k_in, v_in))
    s = einsum("b i d, b j d -> b i j", q, k) * self.scale
    r = einsum("b i j, b j d -> b i d", s.softmax(dim=-1, dtype=q.dtype), v)
    r = r.reshape(b, h, -1, d).permute(0, 2, 1, 3).reshape(b, -1, h * d).to(dtype)
    return self.to_out(r)


def scaled_dot_product_attention_forward(self, x, context=None, mask=None, **kwargs):
    """The built-in ``sdp`` forward: preamble, (b, h, n, d) views, optional upcast, SDPA, cast back, to_out."""
    batch_size, sequence_length, inner_dim = x.shape
    if mask is not None:
        mask = self.prepare_attention_mask(mask, sequence_length, batch_size)  # ldm/sgm have no such method
        mask = mask.view(batch_size, self.heads, -1, mask.shape[-1])
    h = self.heads
    q_in, k_in, v_in = _preamble(self, x, context)
    head_dim = q_in.shape[-1] // h
    q = q_in.view(batch_size, -1, h, head_dim).transpose(1, 2)
    k = k_in.view(batch_size, -1, h, head_dim).transpose(1, 2)
    v = v_in.view(batch_size, -1, h, head_dim).transpose(1, 2)
    dtype = q.dtype
    if shared.opts.upcast_attn:
        q, k, v = q.float(), k.float(), v.float()
    hidden_states = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, h * head_dim)
    hidden_states = hidden_states.to(dtype)
    hidden_states = self.to_out[0](hidden_states)
    hidden_states = self.to_out[1](hidden_states)
    return hidden_states


def scaled_dot_product_no_mem_attention_forward(self, x, context=None, mask=None, **kwargs):
    if torch.cuda.is_available():
        with torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=True, enable_mem_efficient=False):
            return scaled_dot_product_attention_forward(self, x, context, mask)
    return scaled_dot_product_attention_forward(self, x, context, mask)


def cross_attention_attnblock_forward(self, x):
    """Doggettx's AttnBlock forward (unsliced here): bmm attention over pixels."""
    return diffusionmodules_model_AttnBlock_forward(self, x)


def sdp_attnblock_forward(self, x):
    """The built-in ``sdp`` AttnBlock forward: (b, hw, c) single head, 3-D SDPA, cast back, proj_out, residual."""
    h_ = self.norm(x)
    q, k, v = self.q(h_), self.k(h_), self.v(h_)
    b, c, h, w = q.shape
    q, k, v = (t.reshape(b, c, h * w).transpose(1, 2).contiguous() for t in (q, k, v))
    dtype = q.dtype
    if shared.opts.upcast_attn:
        q, k = q.float(), k.float()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    out = out.to(dtype)
    out = out.transpose(1, 2).reshape(b, c, h, w)
    out = self.proj_out(out)
    return x + out


def sdp_no_mem_attnblock_forward(self, x):
    if torch.cuda.is_available():
        with torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=True, enable_mem_efficient=False):
            return sdp_attnblock_forward(self, x)
    return sdp_attnblock_forward(self, x)
