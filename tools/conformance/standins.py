"""Stand-ins for the compiled modules of flash-attn (FA2) and FA3, one per release line.

Each function takes exactly the arguments of that release's C++ entry point, in order
(``csrc/flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_varlen_fwd``; FA3: ``hopper/flash_api.cpp``),
checks what the C++ checks before launching a kernel (dtypes, unit last stride, contiguity where
required, int32 contiguous cu_seqlens of batch+1 entries, integer max_seqlen, shapes, head sizes),
computes attention in float64 and returns that release's tuple. Only the CUDA device checks are left
out: the tensors are on the CPU.
"""
from __future__ import annotations

import math
import sys
import types

import torch


class CppCheckError(RuntimeError):
    """What TORCH_CHECK raises (c10::Error reaches Python as RuntimeError)."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise CppCheckError(message)


def bind(names: tuple, args: tuple, function: str) -> dict:
    """pybind11 without defaults: exactly these positional arguments."""
    if len(args) != len(names):
        raise TypeError(f"{function}(): incompatible function arguments: {len(args)} given, {len(names)} expected "
                        f"({', '.join(names)})")
    return dict(zip(names, args))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def attend(q, k, v, scale, causal=False):
    """(b, s, h, d) attention in float64, returned in q's dtype; k/v heads may divide q's (GQA)."""
    check(not causal, "the stand-in computes non-causal attention only (the engine never asks for causal)")
    h, hk = q.shape[2], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    if hk != h:
        kd, vd = (t.repeat_interleave(h // hk, dim=1) for t in (kd, vd))
    out = torch.softmax((qd @ kd.transpose(-1, -2)) * scale, dim=-1) @ vd
    return out.transpose(1, 2).to(q.dtype).contiguous()


def _common(q, k, v, head_dim_rule):
    check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    head_dim_rule(q.shape[-1])
    check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")


def _fa2_head_dim(padded_by_cpp: bool):
    def rule(d):
        check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        if not padded_by_cpp:
            check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    return rule


def _lse(q, k, scale):
    s = (q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2)) * scale
    return torch.logsumexp(s, dim=-1).float()


FA2_FWD = ("q", "k", "v", "out_", "alibi_slopes_", "p_dropout", "softmax_scale", "is_causal",
           "window_size_left", "window_size_right", "softcap", "return_softmax", "gen_")
FA2_VARLEN_FWD = ("q", "k", "v", "out_", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "leftpad_k_", "block_table_",
                  "alibi_slopes_", "max_seqlen_q", "max_seqlen_k", "p_dropout", "softmax_scale", "zero_tensors",
                  "is_causal", "window_size_left", "window_size_right", "softcap", "return_softmax", "gen_")


def _fa2_checks(a, padded_by_cpp):
    _common(a["q"], a["k"], a["v"], _fa2_head_dim(padded_by_cpp))
    check(a["alibi_slopes_"] is None and a["out_"] is None, "the stand-in takes no alibi slopes or out_")
    check(isinstance(a["softmax_scale"], float), f"softmax_scale must be a float, got {type(a['softmax_scale']).__name__}")
    check(a["p_dropout"] == 0.0, "the engine runs without dropout")
    check(_is_int(a["window_size_left"]) and _is_int(a["window_size_right"]), "window sizes must be ints")


def _pad8(t):
    d = t.shape[-1]
    return t if d % 8 == 0 else torch.nn.functional.pad(t, [0, 8 - d % 8])


def flash_attn_2_cuda(line: str) -> types.ModuleType:
    """The ``flash_attn_2_cuda`` of release line "2.6" (8-tuples, pads head sizes itself) or "2.7"
    (2.7 and 2.8: 4-tuples, head sizes padded by the Python layer)."""
    padded_by_cpp = line == "2.6"
    module = types.ModuleType("flash_attn_2_cuda")

    def fwd(*args):
        a = bind(FA2_FWD, args, "fwd")
        _fa2_checks(a, padded_by_cpp)
        q, k, v = a["q"], a["k"], a["v"]
        b, n, h, d = q.shape
        check(tuple(k.shape) == (b, k.shape[1], k.shape[2], d) and k.shape == v.shape, "k must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)")
        out = attend(q, k, v, a["softmax_scale"], a["is_causal"])
        lse = _lse(q, k, a["softmax_scale"])
        rng = torch.zeros(2, dtype=torch.int64)
        if padded_by_cpp:
            return out, _pad8(q), _pad8(k), _pad8(v), _pad8(out), lse, torch.empty(0), rng
        return out, lse, torch.empty(0), rng

    def varlen_fwd(*args):
        a = bind(FA2_VARLEN_FWD, args, "varlen_fwd")
        _fa2_checks(a, padded_by_cpp)
        q, k, v, cu_q, cu_k = a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"]
        check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
        check(cu_q.is_contiguous() and cu_k.is_contiguous(), "cu_seqlens must be contiguous")
        check(a["seqused_k"] is None and a["block_table_"] is None and a["leftpad_k_"] is None, "unexpected paging args")
        check(_is_int(a["max_seqlen_q"]) and _is_int(a["max_seqlen_k"]), "max_seqlen_q/k must be ints")
        check(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, "q: (total_q, h, d), k/v: (total_k, h_k, d)")
        batch = cu_q.numel() - 1
        check(cu_k.numel() == batch + 1, "cu_seqlens_k must have shape (batch_size + 1)")
        check(int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0], "cu_seqlens must end at total_q/total_k")
        lens_q, lens_k = cu_q.diff(), cu_k.diff()
        check(int(lens_q.max()) <= a["max_seqlen_q"] and int(lens_k.max()) <= a["max_seqlen_k"],
              "max_seqlen below a sequence's length: the kernel would read past it")
        out = torch.empty_like(q)
        for i in range(batch):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            out[qs] = attend(q[qs][None], k[ks][None], v[ks][None], a["softmax_scale"], a["is_causal"])[0]
        lse = torch.zeros(q.shape[1], q.shape[0])
        rng = torch.zeros(2, dtype=torch.int64)
        if padded_by_cpp:
            return out, _pad8(q), _pad8(k), _pad8(v), _pad8(out), lse, torch.empty(0), rng
        return out, lse, torch.empty(0), rng

    module.fwd, module.varlen_fwd = fwd, varlen_fwd
    return module


# --- FA3 (hopper/) -------------------------------------------------------------------------------

FA3_26_FWD = ("q", "k", "v", "out_", "softmax_scale", "is_causal")
FA3_27_FWD = ("q", "k", "v", "k_new_", "v_new_", "out_", "cu_seqlens_q_", "cu_seqlens_k_", "cu_seqlens_k_new_",
              "seqused_q_", "seqused_k_", "max_seqlen_q_", "max_seqlen_k_", "page_table_", "kv_batch_idx_",
              "leftpad_k_", "rotary_cos_", "rotary_sin_", "q_descale_", "k_descale_", "v_descale_",
              "softmax_scale", "is_causal", "window_size_left", "window_size_right", "sink_token_length",
              "softcap", "is_rotary_interleaved", "num_splits", "pack_gqa_", "sm_margin")
#: hopper/flash_api.cpp of 2.8.3, TORCH_LIBRARY(flash_attn_3, m) m.def("fwd(...)").
FA3_28_SCHEMA = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new = None, Tensor(v_new!)? v_new = None, "
    "Tensor? q_v = None, Tensor(out!)? out = None, Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None, "
    "Tensor? cu_seqlens_k_new = None, Tensor? seqused_q = None, Tensor? seqused_k = None, "
    "int? max_seqlen_q = None, int? max_seqlen_k = None, Tensor? page_table = None, "
    "Tensor? kv_batch_idx = None, Tensor? leftpad_k = None, Tensor? rotary_cos = None, "
    "Tensor? rotary_sin = None, Tensor? seqlens_rotary = None, Tensor? q_descale = None, "
    "Tensor? k_descale = None, Tensor? v_descale = None, float? softmax_scale = None, "
    "bool is_causal = False, int window_size_left = -1, int window_size_right = -1, "
    "int attention_chunk = 0, float softcap = 0.0, bool is_rotary_interleaved = False, "
    "Tensor? scheduler_metadata = None, int num_splits = 0, bool? pack_gqa = None, "
    "int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)")


def _fa3_dense(q, k, v, scale, causal, *, fixed_head_dims=None, contiguous=False):
    def rule(d):
        check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        if fixed_head_dims:
            check(d in fixed_head_dims, "Only support head size 64, 128, and 256 for now")
    _common(q, k, v, rule)
    if contiguous:
        for t in (q, k, v):
            check(t.is_contiguous(), "Input tensor must be contiguous")
    check(q.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[-1] == q.shape[-1],
          "q: (b, s_q, h, d), k/v: (b, s_k, h_k, d)")
    check(isinstance(scale, float), "softmax_scale must be a float")
    return attend(q, k, v, scale, causal), _lse(q, k, scale)


def _schema_args(schema: str):
    inner = schema[schema.index("(") + 1:schema.index(") ->")]
    for part in inner.split(","):
        decl, _, default = part.strip().partition(" = ")
        yield decl.split()[-1], default


def _schema_names(schema: str) -> list:
    return [name for name, _ in _schema_args(schema)]


def _schema_defaults(schema: str) -> dict:
    values = {"None": None, "False": False, "True": True}
    out = {}
    for name, default in _schema_args(schema):
        if default:
            out[name] = values[default] if default in values else (float(default) if "." in default else int(default))
    return out


def fa3_modules(line: str) -> dict:
    """sys.modules entries standing in for FA3's compiled module of release line "2.6", "2.7" or "2.8"."""
    if line == "2.6":
        module = types.ModuleType("flashattn_hopper_cuda")

        def fwd(*args):
            a = bind(FA3_26_FWD, args, "fwd")
            check(a["out_"] is None, "the stand-in takes no out_")
            out, lse = _fa3_dense(a["q"], a["k"], a["v"], a["softmax_scale"], a["is_causal"],
                                  fixed_head_dims=(64, 128, 256), contiguous=True)
            return out, a["q"], a["k"], a["v"], out, lse, torch.empty(0)

        module.fwd = fwd
        return {"flashattn_hopper_cuda": module}
    if line == "2.7":
        module = types.ModuleType("flash_attn_3_cuda")

        def fwd(*args):
            a = bind(FA3_27_FWD, args, "fwd")
            unused = [n for n in FA3_27_FWD[3:21] if a[n] is not None]
            check(not unused, f"the stand-in computes dense attention only; got {unused}")
            out, lse = _fa3_dense(a["q"], a["k"], a["v"], a["softmax_scale"], a["is_causal"])
            return out, lse, torch.empty(0), torch.empty(0)

        module.fwd = fwd
        return {"flash_attn_3_cuda": module}
    if line == "2.8":
        lib = torch.library.Library("flash_attn_3", "DEF")
        lib.define(FA3_28_SCHEMA)

        def fwd(*args, **kwargs):
            # The dispatcher hands over what the caller passed; the schema's defaults fill the rest.
            a = dict(_schema_defaults(FA3_28_SCHEMA))
            a.update(zip(_schema_names(FA3_28_SCHEMA), args), **kwargs)
            dense = ("k_new", "v_new", "q_v", "cu_seqlens_q", "cu_seqlens_k", "page_table", "q_descale",
                     "k_descale", "v_descale")
            check(all(a[n] is None for n in dense), "the stand-in computes dense attention only")
            result, lse = _fa3_dense(a["q"], a["k"], a["v"], a["softmax_scale"], a["is_causal"])
            out = a["out"]
            if out is None:
                out = result
            else:
                out.copy_(result)
            return out, lse, torch.empty(0), torch.empty(0)

        lib.impl("fwd", fwd, "CPU")
        package = types.ModuleType("flash_attn_3")
        package.__path__ = []
        compiled = types.ModuleType("flash_attn_3._C")
        package._C = compiled
        package._library = lib  # keeps the registration alive
        return {"flash_attn_3": package, "flash_attn_3._C": compiled}
    raise ValueError(f"no FA3 stand-in for release line {line!r} (2.6, 2.7, 2.8)")


def install(modules: dict) -> None:
    sys.modules.update(modules)


def allow_cpu_custom_ops(module) -> int:
    """flash-attn 2.7+ wraps its forward in ``torch.library.custom_op(..., device_types="cuda")``; give
    each such op a CPU kernel that is its own Python body, so the real layer runs on CPU tensors."""
    count = 0
    for value in vars(module).values():
        init = getattr(value, "_init_fn", None)
        if init is not None and hasattr(value, "register_kernel"):
            value.register_kernel("cpu")(init)
            count += 1
    return count


def scale_of(d: int) -> float:
    return 1.0 / math.sqrt(d)
