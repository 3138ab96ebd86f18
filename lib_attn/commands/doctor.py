"""``python -m lib_attn doctor``: what this machine has and what the engine would run.

Reports the environment (``environment``: versions, the device, every backend with its version or
the reason it is not available), the current configuration and stored tuning, and for
each model's attention calls the backend the engine would pick now and why the
ones ahead of it in the chain were passed over. Decisions come from
``lib_attn.explain`` on empty tensors of the real shapes: no kernel runs. Given a described device
(a ``DeviceInfo``, e.g. an MI300 or a Mac on a machine that has neither), the same report is made
from the call metadata alone, as the engine decides before PyTorch's own checks can run.
"""
from __future__ import annotations

from typing import List, Optional

import torch

import lib_attn
from lib_attn import shapes, tune
from lib_attn import tuning_file
from lib_attn.device import default_device, miopen_text
from lib_attn.kernels import sdpa as sdpa_kernels
from lib_attn.spec import spec_of

from .dtypes import default_dtype, dtype_name
from .environment import environment
from .formats import shown


CLEAR_COMMAND = "python -m lib_attn tune --clear"


def _config_dict() -> dict:
    cfg = lib_attn.config()
    pref = {role: (list(p) if p else "auto") for role, p in (cfg.preference or {}).items()}
    return {"preference": pref, "fp32": cfg.fp32, "strict": bool(cfg.strict), "tune": cfg.tune, "guard": cfg.guard,
            "schedule": cfg.schedule.text if cfg.schedule is not None else None}


def _tuning_dict(device: torch.device, info=None) -> dict:
    """The tuning mode, whether it measures on this device, and the stored file."""
    mode = lib_attn.config().tune
    table = tuning_file.table(info or lib_attn.device_info(device))
    return {"mode": mode, "active": tune.enabled(mode, device.type), "file": table["file"],
            "stored": len(table["entries"])}


def _empty_inputs(call: shapes.AttentionCall, dtype: torch.dtype, device: torch.device):
    """Uninitialised q, k, v with A1111's strides (transposed views of (b, s, h·d))."""
    def proj(seq: int) -> torch.Tensor:
        x = torch.empty(call.b, seq, call.heads * call.head_dim, dtype=dtype, device=device)
        return x.view(call.b, seq, call.heads, call.head_dim).transpose(1, 2)

    return proj(call.q_len), proj(call.kv_len), proj(call.kv_len)


def _described(call: shapes.AttentionCall, dtype: torch.dtype, info):
    """The decision for ``call`` on a described device, from its metadata alone."""
    from lib_attn.chains import chain_for
    from lib_attn.decision import decide
    from lib_attn.config import current
    from lib_attn.spec import CallSpec

    spec = CallSpec(info, dtype, call.b, call.heads, call.q_len, call.kv_len, call.head_dim, role=call.role)
    cfg = current()
    chain, explicit = chain_for(call.role, info, None, cfg, spec)
    return decide(spec, chain, fp32=cfg.fp32, explicit=explicit)


def decisions(device: torch.device, dtype: Optional[torch.dtype] = None,
              models=shapes.IMAGE_MODELS, res: Optional[int] = None, info=None) -> List[dict]:
    """For each model's calls: the backend the current configuration picks, and why
    the ones before it were passed over. With ``info`` (a described device) from metadata alone."""
    out = []
    for model in models:
        for call in shapes.model_calls(model, res):
            dt = dtype or default_dtype(call.role, gpu=device.type != "cpu")
            stored = None
            if info is not None:
                d = _described(call, dt, info)
            else:
                q, k, v = _empty_inputs(call, dt, device)
                d = lib_attn.explain(q, k, v, role=call.role)
                stored = tuning_file.lookup(spec_of(q, k, v, None, "bhsd", call.role), lib_attn.config().fp32)
                del q, k, v
            cast = getattr(d, "cast", None)
            out.append({
                "model": model, "res": call.res, "where": call.where, "kind": call.kind,
                "role": call.role, "shape": list(call.shape), "calls": call.calls,
                "dtype": dtype_name(dt),
                "backend": d.backend, "variant": getattr(d, "variant", "") or "",
                "cast": str(cast).replace("torch.", "") if cast else None,
                "rejected": [[bid, list(reasons)] for bid, reasons in (d.rejected or [])],
                "source": d.source,
                "stored": None if stored is None else {"timings": stored["timings"], "rejected": stored["rejected"],
                                                       "measured": stored.get("measured")},
            })
    return out


def _flex_compiler(device_type: str) -> str:
    """What compiled FlexAttention needs on ``device_type``, found or not, without compiling anything:
    a C++ compiler on a CPU (inductor's), Triton on a GPU."""
    import importlib.util
    import os
    import shutil

    if device_type == "cuda":
        return "Triton found" if importlib.util.find_spec("triton") else "no Triton: the gather design serves"
    found = next((shutil.which(c) for c in (os.environ.get("CXX") or "", "g++", "c++", "clang++") if c and shutil.which(c)),
                 None)
    return f"C++ compiler {found}" if found else "no C++ compiler found: the gather design serves"


def _sparse_dict(device: torch.device, info=None) -> dict:
    """The sparse settings in force and every sparse backend with its probe, and block-sparse's design:
    FlexAttention (with the compiler it needs) or the gather one."""
    from lib_attn.kernels import REGISTRY
    from lib_attn.kernels.block_sparse import flex

    settings = lib_attn.config().sparse
    backends = [{"id": b.id, "label": b.label, "available": bool(b.available), "version": b.version or None,
                 "reason": b.reason or "", "packages": list(b.packages)} for b in lib_attn.backends(sparse=True)]
    for b in backends:
        backend = REGISTRY[b["id"]]
        if b["available"] and hasattr(backend, "design") and info is None:
            design = backend.design(device.type)
            b["design"] = design
            if design == "flex":
                b["compiler"] = _flex_compiler(device.type)
            elif getattr(backend, "flex_failures", None):
                b["compiler"] = f"FlexAttention failed here: {next(iter(backend.flex_failures.values()))}"
            elif not flex.available():
                b["compiler"] = "this torch has no FlexAttention (torch 2.5 and later)"
            else:
                b["compiler"] = f"FlexAttention with the pooled term does not run on {device.type}: the gather design serves"
    return {"settings": settings.text if settings is not None else None, "backends": backends}


def _diffusers_dict() -> dict:
    """The installed diffusers (from its metadata: nothing is imported) and the releases ``route`` supports."""
    from importlib import metadata

    from lib_attn.integrations.diffusers import SUPPORTED
    try:
        installed = metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        installed = None
    low, high = (".".join(map(str, v)) for v in SUPPORTED)
    return {"installed": installed, "supported": f"{low} up to {high} excluded"}


def report(device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, info=None) -> dict:
    """The whole report; ``info`` (a ``DeviceInfo``) describes a device this machine need not have."""
    if info is not None:
        device = torch.device(info.type)
    if device is None:
        device = torch.device(default_device())
    doc = environment(device, info)
    doc["schema"] = "lib_attn.doctor/1"
    doc["config"] = _config_dict()
    found = sdpa_kernels.replacement()
    doc["sdpa_replaced_by"] = None if found is None else sdpa_kernels.callable_name(found)
    doc["tuning"] = _tuning_dict(device, info)
    doc["guard"] = {"mode": lib_attn.config().guard, "clear": CLEAR_COMMAND,
                    "rejected": tuning_file.remembered(info or lib_attn.device_info(device))}
    doc["sparse"] = _sparse_dict(device, info)
    doc["diffusers"] = _diffusers_dict()
    doc["decisions"] = decisions(device, dtype, info=info)
    if info is not None:
        doc["described"] = True
    return doc


def render(doc: dict) -> str:
    """The text report of ``report()``'s document."""
    v, dev = doc["versions"], doc["device"]
    lines = [
        "lib_attn doctor" + (" (described device: decisions from call metadata, no PyTorch checks)"
                             if doc.get("described") else ""),
        f"  python    {v['python']} ({v['platform']})",
        f"  torch     {v['torch']}",
    ]
    if doc.get("sdpa_replaced_by"):
        lines.append(f"  SDPA      F.scaled_dot_product_attention is replaced by {doc['sdpa_replaced_by']}: sdpa runs "
                     "PyTorch's own; choose sdpa-host to run the replacement")
    if dev.get("platform") == "rocm":
        lines += [f"  ROCm      HIP {v.get('hip') or '?'}",
                  f"  MIOpen    {miopen_text(v.get('miopen'))}"]
    elif dev.get("platform") == "mps":
        lines += [f"  MPS       macOS {'.'.join(map(str, dev['macos'])) if dev.get('macos') else '?'}"]
    else:
        lines += [f"  CUDA      {v['cuda'] or 'none (this torch has no CUDA)'}"
                  + ("" if v["cuda"] is None or dev["type"] == "cuda" else " - no usable GPU found"),
                  f"  cuDNN     {shown(v['cudnn'])}"]
    lines += [f"  device    {dev['description']}",
              f"  lib_attn  {v['lib_attn'] or '-'}"]
    cfg = doc["config"]
    prefs = {r: (p if p == "auto" else ",".join(p)) for r, p in cfg["preference"].items()}
    same = len(set(prefs.values())) == 1
    pref_text = next(iter(prefs.values())) if same and prefs else \
        "; ".join(f"{r}: {p}" for r, p in prefs.items())
    lines.append(f"  config    preference {pref_text}, fp32 {cfg['fp32']}, "
                 f"strict {'on' if cfg['strict'] else 'off'}, tune {cfg['tune']}, guard {cfg['guard']}"
                 + (f", schedule {cfg['schedule']!r}" if cfg.get("schedule") else ""))
    t = doc["tuning"]
    lines.append(f"  tuning    {'measures' if t['active'] else 'off'} on {dev['type']}; {t['stored']} call kinds "
                 f"stored for this machine in {t['file']}")
    g = doc["guard"]
    lines.append(f"  guard     {g['mode']}; {len(g['rejected'])} output check failures remembered for this machine"
                 + (f" (forget them with: {g['clear']}, which also forgets the stored tuning)"
                    if g["rejected"] else ""))
    lines += [f"    {r['backend']} for {r['signature']}: {r['reason']}" for r in g["rejected"]]
    lines += ["", "backends"]
    w = max(len(b["id"]) for b in doc["backends"])
    for b in doc["backends"]:
        state = "yes" if b["available"] else "no "
        ver = b["version"] or "-"
        tail = f"  {b['reason']}" if not b["available"] and b["reason"] else ""
        lines.append(f"  {b['id']:<{w}}  {state}  {ver}{tail}")
    sp = doc.get("sparse")
    if sp is not None:
        lines += ["", f"sparse attention: {sp['settings'] or 'off'} (lib_attn.configure(sparse=...); docs/sparse.md)"]
        w = max((len(b["id"]) for b in sp["backends"]), default=0)
        for b in sp["backends"]:
            state = "yes" if b["available"] else "no "
            tail = f"  {b['reason']}" if not b["available"] and b["reason"] else ""
            design = f"  design {b['design']}" if b.get("design") else ""
            compiler = f" ({b['compiler']})" if b.get("compiler") else ""
            lines.append(f"  {b['id']:<{w}}  {state}  {b['version'] or '-'}{tail}{design}{compiler}")
    d = doc.get("diffusers")
    if d is not None:
        lines += ["", f"diffusers {d['installed'] or 'not installed'}; route() supports {d['supported']}"]
    lines += ["", "packages (from their metadata; what each backend's probe looks for)"]
    users: dict = {}
    for b in doc["backends"] + (doc.get("sparse") or {}).get("backends", []):
        for name in b.get("packages", ()):
            users.setdefault(name, []).append(b["id"])
    w = max(len(name) for name in v["packages"])
    for name, version in v["packages"].items():
        used = f"  ({', '.join(users[name])})" if name in users else ""
        lines.append(f"  {name:<{w}}  {version or 'not installed'}{used}")
    lines += ["", f"decisions with the current configuration on {dev.get('arch') or dev.get('platform') or dev['type']} "
              "(per call kind: backend <- passed over)"]
    unavailable = {b["id"] for b in doc["backends"] if not b["available"]}
    last = None
    for d in doc["decisions"]:
        if (d["model"], d["res"]) != last:
            last = (d["model"], d["res"])
            lines.append(f"  {shapes.MODEL_LABELS[d['model']]} @ {d['res']} "
                         f"(role {d['role']}, {d['dtype']})")
        shape = ",".join(str(x) for x in d["shape"])
        extra = "".join([f" ({d['variant']})" if d["variant"] else "",
                         f" [cast to {d['cast']}]" if d["cast"] else ""])
        tuned = f" [tuned: {d['source']}]" if d["source"] != "order" else ""
        lines.append(f"    {d['where']:<13} {'(' + shape + ')':<21} ×{d['calls']:<3} -> {d['backend']}{extra}{tuned}")
        if d["stored"]:
            ranked = sorted(d["stored"]["timings"].items(), key=lambda item: item[1])
            lines.append("        stored tuning: " + ", ".join(
                [f"{bid} {tune.ms_text(t)}" for bid, t in ranked]
                + [f"{bid} rejected ({why})" for bid, why in d["stored"]["rejected"].items()]))
        for bid, reasons in d["rejected"]:
            why = "not available (see backends)" if bid in unavailable else "; ".join(reasons)
            lines.append(f"        {bid}: {why}")
    return "\n".join(lines)

