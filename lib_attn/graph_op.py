"""The engine's eager call as one opaque operator for torch.compile.

Traced by Dynamo, the dispatcher would bake its cached decision into the graph and guard on its call
counters, so a compiled model would recompile on every run, and Inductor could rewrite a traced
kernel into another one. Under torch.compile the call is therefore the custom operator
``lib_attn::attention``: the graph holds the operator, and deciding, counting and falling back happen
each time it runs.

This module sits below the dispatcher and knows nothing of it: ``dispatch`` hands its eager
``attention`` to ``operator`` once, at import, and sends traced calls to what it gets back, so an
eager call pays one compile check.

On torch older than 2.4 (no ``torch.library.custom_op``) a traced call leaves the graph instead
(``torch._dynamo.disable``): one graph break per attention call, decided and counted when it runs.
"""
from __future__ import annotations

import torch

from . import _compat

#: The engine's eager call, set by ``operator``; the operator itself is registered once per process.
_engine = None

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? mask, str layout, float? scale, str role, str? backend, "
          "str? fp32, bool exact=False) -> Tensor")


def _run(q, k, v, mask, layout, scale, role, backend, fp32, exact=False):
    out = _engine(q, k, v, layout=layout, mask=mask, scale=scale, role=role, backend=backend, fp32=fp32, exact=exact)
    # The compiled graph reads the result with the fake's (contiguous) strides, whichever backend ran.
    return out if out.is_contiguous() else out.contiguous()


def _fake(q, k, v, mask, layout, scale, role, backend, fp32, exact=False):
    return q.new_empty(q.shape)


def _backward_math(q, k, v, mask, scale, grad):
    """Gradients of softmax(q kᵀ·scale + mask) v on (b, h, seq, d) tensors, from the formula:
    no backend's own backward is reachable from inside the operator. Computed in fp32 for half input."""
    dtype = q.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v, grad = (t.to(compute) for t in (q, k, v, grad))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(compute)
    probs = torch.softmax(scores, dim=-1)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad)
    grad_probs = torch.matmul(grad, v.transpose(-1, -2))
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    return grad_q.to(dtype), grad_k.to(dtype), grad_v.to(dtype), grad_scores


def _setup_context(ctx, inputs, output):
    q, k, v, mask, layout, scale = inputs[:6]
    ctx.save_for_backward(q, k, v, mask)
    ctx.layout, ctx.scale = layout, scale


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    if ctx.layout == "bshd":
        q, k, v, grad = (t.transpose(1, 2) for t in (q, k, v, grad))
    *grads, grad_scores = _backward_math(q, k, v, mask, ctx.scale, grad)
    if ctx.layout == "bshd":
        grads = [g.transpose(1, 2) for g in grads]
    # A float mask that requires grad (a learned bias) is added to the scores: its gradient is theirs,
    # summed over the dimensions it was broadcast along.
    wants = getattr(ctx, "needs_input_grad", None)
    grad_mask = None
    if mask is not None and mask.is_floating_point() and (wants[3] if wants else mask.requires_grad):
        grad_mask = grad_scores.sum_to_size(mask.shape).to(mask.dtype)
    return (*grads, grad_mask) + (None,) * 6


_op = None


def _register():
    if _compat.CUSTOM_OP is not None:
        op = _compat.CUSTOM_OP("lib_attn::attention", _run, mutates_args=(), schema=SCHEMA)
        op.register_fake(_fake)
        op.register_autograd(_backward, setup_context=_setup_context)
        return op
    return torch._dynamo.disable(_run)


def traced(q, k, v, mask, layout, scale, role, backend, fp32, exact=False):
    """The call as the graph holds it: the operator, which runs the engine when the graph runs."""
    return _op(q, k, v, mask, layout, None if scale is None else float(scale), role, backend, fp32, bool(exact))


def operator(engine):
    """Make ``engine`` (the eager ``attention(q, k, v, *, layout, mask, scale, role, backend, fp32, exact)``)
    what the operator runs; returns ``traced``, the call a traced ``attention`` makes instead."""
    global _engine, _op
    _engine = engine
    if _op is None:
        _op = _register()
    return traced
