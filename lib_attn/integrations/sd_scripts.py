"""Route kohya-ss/sd-scripts' attention through the engine, for training.

    accelerate launch [accelerate options] -m lib_attn.integrations.sd_scripts [engine options] \\
        flux_train_network.py [the trainer's own arguments]

or, in a small wrapper script of one's own, before sd-scripts' modules run:

    from lib_attn.integrations import sd_scripts
    routing = sd_scripts.route(report_every=300)
    ...                                  # run the trainer
    routing.undo()                       # logs the final report; nothing stays patched

sd-scripts (seen at 48d368fa) calls attention in four places, each routed where it is defined,
without changing sd-scripts' files; modules imported later are routed as they load (an import hook):

- ``library.flux_models.attention(q, k, v, pe, attn_mask)`` (Flux; Chroma imports it by name into
  ``library.chroma_models``): rotary ``pe`` applied by the module's own ``apply_rope``, then the engine
  in (B, H, L, D), the output as (B, L, H*D). The T5 mask (``--apply_t5_attn_mask``) arrives as a bool
  key mask expanded over heads and queries; the engine gets it as the key-padding mask it is, which
  flash-attn serves through its varlen kernel.
- ``library.attention.attention`` (HunyuanImage imports it by name into
  ``library.hunyuan_image_modules``; Anima calls it through the module): the list of tensors it is
  given is cleared as sd-scripts clears it; equal valid lengths trim the call and pad the output back
  with zeros; ``split_attn`` runs each sample on its valid length and pads with zeros; otherwise the
  valid lengths become one key-padding mask, whatever ``attn_mode`` built (the torch mode's bool
  mask, or the flash and sage modes' cu_seqlens). The rows of valid tokens equal sd-scripts' torch
  mode; the padding rows, which no valid token attends to, are those of the torch mode too (the flash
  and sage modes' own padding rows attend only to each other). Dropout, and the xformers mode's
  block-diagonal bias, run sd-scripts' own code, counted as passed over.
- ``CrossAttention.forward`` of ``library.original_unet`` (SD1/SD2) and ``library.sdxl_original_unet``
  (SDXL): a processor set on the module runs first, as in sd-scripts; ``to_q``, ``to_k``, ``to_v``
  and ``to_out`` are still called as modules (LoRA replaces their forwards); the context is cast to
  the hidden states' dtype on the xformers, mem_eff and sdpa paths, not on the default one, which
  upcasts q and k when ``upcast_attention`` is set; only the sdpa path passes a mask.
- ``library.sd3_models.attention(q, k, v, head_dim, mask, scale, mode)``: k and v cast to q's dtype and
  device, heads split as sd-scripts splits them; its ``math`` mode, and a mask in ``xformers`` mode,
  run sd-scripts' own code.

The engine's configuration is set process-wide (``lib_attn.configure``), never in a scope: gradient
checkpointing recomputes attention inside the backward, on CUDA on autograd's own threads, where it
must hold too. The report counts every thread's calls (a process-wide ``lib_attn.Recording``): kernels
x calls, those recomputed in a backward, fallbacks with their reasons, time and peak memory; it is
logged every ``report_every`` seconds and at the end, and written into each safetensors file the
trainer saves with sd-scripts' ``ss_*`` metadata, under ``lib_attn_report`` (JSON). Under DDP each rank
routes its own calls and logs its own report; the routing adds no collective.
"""
from __future__ import annotations

import argparse
import importlib.abc
import json
import logging
import os
import runpy
import sys
import threading
import time
from functools import wraps

import torch

from .. import stats
from ..config import configure
from ..dispatch import attention as _engine
from ..report import MIB, Report, VramProbe

log = logging.getLogger("lib_attn")

#: The metadata key of the report in a saved model, beside sd-scripts' ``ss_*`` keys.
METADATA_KEY = "lib_attn_report"
#: How sd-scripts' code is told from the routed one: the original a routed function stands for.
ORIGINAL = "__lib_attn_original__"
#: What a call the engine does not take is counted under, as passed over: (role, PASSED_OVER, reason).
PASSED_OVER = "lib_attn"


# --- the routed functions ------------------------------------------------------------------------

def _unserved(role: str, reason: str) -> None:
    stats.count("fallbacks", (role, PASSED_OVER, reason), 1, ())


def key_padding(mask):
    """A bool mask expanded over heads and queries (stride 0 there, as ``expand`` makes it) as the
    (B, 1, 1, L) key-padding mask it is; any other mask as it is."""
    if (mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.stride(1) == 0
            and mask.stride(2) == 0):
        return mask[:, :1, :1, :]
    return mask


def flux_attention(original, apply_rope):
    """``flux_models.attention`` routed: rope by sd-scripts' ``apply_rope``, the engine in (B, H, L, D)."""

    @wraps(original)
    def attention(q, k, v, pe, attn_mask=None):
        q, k = apply_rope(q, k, pe)
        x = _engine(q, k, v, mask=key_padding(attn_mask), role="dit")
        b, h, n, d = x.shape
        return x.transpose(1, 2).reshape(b, n, h * d)

    setattr(attention, ORIGINAL, original)
    return attention


def _bshd(q, k, v, mask=None, scale=None, role="dit"):
    return _engine(q, k, v, layout="bshd", mask=mask, scale=scale, role=role)


def unified_attention(original, params_type):
    """``library.attention.attention`` routed (see the module's docstring for what each case gives)."""

    @wraps(original)
    def attention(qkv_or_q, k=None, v=None, attn_params=None, drop_rate=0.0):
        if isinstance(qkv_or_q, list):
            q, k, v = qkv_or_q
            qkv_or_q.clear()  # the caller's references go, as sd-scripts lets them go
        else:
            q = qkv_or_q
            assert k is not None and v is not None, "k and v must be provided if qkv_or_q is a tensor"
        del qkv_or_q
        p = attn_params if attn_params is not None else params_type.create_attention_params("torch", False)
        mask = p.attention_mask
        if drop_rate:
            _unserved("dit", "attention dropout")
            return original(q, k, v, attn_params, drop_rate)
        if mask is not None and not isinstance(mask, torch.Tensor):
            _unserved("dit", f"{p.attn_mode} mode's {type(mask).__name__}")
            return original(q, k, v, attn_params, drop_rate)
        b, n = q.shape[:2]
        if not p.split_attn and mask is not None and p.seqlens is not None and bool((p.seqlens == p.seqlens[0]).all()):
            valid = int(p.seqlens[0])
            x = _bshd(q[:, :valid], k[:, :valid], v[:, :valid]).reshape(b, valid, -1)
            return torch.nn.functional.pad(x, (0, 0, 0, p.max_seqlen - valid))
        if p.split_attn:
            lengths = [int(s) for s in p.seqlens] if p.seqlens is not None else [n] * b
            width = p.max_seqlen if p.seqlens is not None else n
            parts = []
            for i, valid in enumerate(lengths):
                x = _bshd(q[i:i + 1, :valid], k[i:i + 1, :valid], v[i:i + 1, :valid]).reshape(1, valid, -1)
                parts.append(torch.nn.functional.pad(x, (0, 0, 0, width - valid)))
            del q, k, v
            return torch.cat(parts, dim=0)
        if mask is not None:
            if mask.dtype == torch.bool and mask.dim() == 4:  # the torch mode's own (B, 1, 1, L) mask
                mask = key_padding(mask)
            else:  # the flash and sage modes keep lengths: valid tokens first
                mask = (torch.arange(n, device=q.device)[None, :] < p.seqlens.to(q.device)[:, None])[:, None, None, :]
        return _bshd(q, k, v, mask).reshape(b, n, -1)

    setattr(attention, ORIGINAL, original)
    return attention


def cross_attention_forward(original):
    """``CrossAttention.forward`` (original_unet / sdxl_original_unet) routed, path by path."""

    @wraps(original)
    def forward(self, hidden_states, context=None, mask=None, **kwargs):
        if getattr(self, "processor", None) is not None or kwargs:
            return original(self, hidden_states, context, mask, **kwargs)
        xformers = self.use_memory_efficient_attention_xformers
        mem_eff = self.use_memory_efficient_attention_mem_eff
        sdpa = self.use_sdpa and not (xformers or mem_eff)
        default = not (xformers or mem_eff or self.use_sdpa)
        if mem_eff and mask is not None:
            _unserved("unet", "mem_eff path's mask")
            return original(self, hidden_states, context, mask)
        x = hidden_states
        q = self.to_q(x)
        context = context if context is not None else x
        if not default:
            context = context.to(x.dtype)
        k = self.to_k(context)
        v = self.to_v(context)
        h = self.heads
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, t.shape[2] // h) for t in (q, k, v))
        if default:
            # sd-scripts' own math: q and k upcast when the model asks, probabilities cast to v's dtype.
            dtype = v.dtype
            if self.upcast_attention or q.dtype != v.dtype:
                q, k, v = q.float(), k.float(), v.float()
            out = _bshd(q, k, v, scale=self.scale, role="unet").to(dtype)
        else:
            out = _bshd(q, k, v, mask=mask if sdpa else None, role="unet")
        out = out.reshape(out.shape[0], out.shape[1], -1)
        return self.to_out[0](out)

    setattr(forward, ORIGINAL, original)
    return forward


def sd3_attention(original):
    """``sd3_models.attention`` routed for its torch and xformers modes."""

    @wraps(original)
    def attention(q, k, v, head_dim, mask=None, scale=None, mode="xformers"):
        if mode not in ("torch", "xformers") or (mode == "xformers" and mask is not None):
            _unserved("dit", f"sd3 {mode} mode{' with a mask' if mask is not None else ''}")
            return original(q, k, v, head_dim, mask=mask, scale=scale, mode=mode)
        if mode == "torch":
            assert scale is None
        k, v = k.to(q), v.to(q)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], -1, head_dim) for t in (q, k, v))
        out = _bshd(q, k, v, mask=mask, scale=scale)
        return out.reshape(out.shape[0], out.shape[1], -1)

    setattr(attention, ORIGINAL, original)
    return attention


def _flux(module):
    return {"attention": lambda f: flux_attention(f, module.apply_rope)}


def _chroma(module):
    flux = sys.modules.get("library.flux_models")
    rope = getattr(module, "apply_rope", None) or flux.apply_rope
    return {"attention": lambda f: flux_attention(f, rope)}


def _unified(module):
    params = getattr(module, "AttentionParams", None) or sys.modules["library.attention"].AttentionParams
    return {"attention": lambda f: unified_attention(f, params)}


def _unet(module):
    return {"CrossAttention.forward": cross_attention_forward}


def _sd3(module):
    return {"attention": sd3_attention}


#: Module -> what routes it: {attribute path: routed(original)}.
TARGETS = {
    "library.flux_models": _flux,
    "library.chroma_models": _chroma,
    "library.attention": _unified,
    "library.hunyuan_image_modules": _unified,
    "library.original_unet": _unet,
    "library.sdxl_original_unet": _unet,
    "library.sd3_models": _sd3,
}


# --- routing and undoing -------------------------------------------------------------------------

def _owner(module, path: str):
    *parents, name = path.split(".")
    obj = module
    for part in parents:
        obj = getattr(obj, part)
    return obj, name


class _Loader(importlib.abc.Loader):
    """A module's own loader, routing the module once it has run."""

    def __init__(self, loader, routing: "Routing"):
        self.loader = loader
        self.routing = routing

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.routing.patch(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds sd-scripts' attention modules with the finders after it and routes them as they load."""

    def __init__(self, routing: "Routing"):
        self.routing = routing

    def find_spec(self, name, path=None, target=None):
        if name not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.routing)
                return spec
        return None


class Routing:
    """sd-scripts' attention routed through the engine until ``undo``; its report (``report``)."""

    def __init__(self, report_every: float | None = None, device=None):
        self.patched: list = []  # (owner, name, original), in the order they were routed
        self.recording = stats.Recording()
        self.started = time.perf_counter()
        self.device = device
        self._finder = _Finder(self)
        self._halt = threading.Event()
        self._thread = None
        self._lock = threading.Lock()
        self._save_file = None
        self.done = False
        sys.meta_path.insert(0, self._finder)
        for name in TARGETS:
            if name in sys.modules:
                self.patch(sys.modules[name])
        self._route_saving()
        if report_every:
            self._thread = threading.Thread(target=self._every, args=(report_every,), name="lib_attn report",
                                            daemon=True)
            self._thread.start()

    def patch(self, module) -> None:
        """Route ``module``'s attention (one of ``TARGETS``); what is routed already stays as it is."""
        with self._lock:
            for path, routed in TARGETS[module.__name__](module).items():
                owner, name = _owner(module, path)
                current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
                if current is None or any(o is owner and n == name for o, n, _ in self.patched):
                    continue
                if hasattr(current, ORIGINAL):  # bound by name from a module routed before (Chroma's import)
                    self.patched.append((owner, name, getattr(current, ORIGINAL)))
                    continue
                setattr(owner, name, self._live(routed(current), current))
                self.patched.append((owner, name, current))

    def _live(self, routed, original):
        """``routed`` while this routing holds, ``original`` after ``undo``: a module that bound the routed
        function by name where ``undo`` does not reach runs sd-scripts' own code again."""

        @wraps(routed)
        def call(*args, **kwargs):
            return (original if self.done else routed)(*args, **kwargs)

        return call

    def _route_saving(self) -> None:
        """Add the report to the metadata of every safetensors file saved with sd-scripts' ``ss_*`` keys."""
        try:
            import safetensors.torch as st
        except ImportError:
            return
        original = st.save_file
        routing = self

        @wraps(original)
        def save_file(tensors, filename, metadata=None, *args, **kwargs):
            if not routing.done and isinstance(metadata, dict) and any(str(key).startswith("ss_") for key in metadata):
                metadata = {**metadata, METADATA_KEY: json.dumps(routing.report().to_dict(), ensure_ascii=False)}
            return original(tensors, filename, metadata, *args, **kwargs)

        setattr(save_file, ORIGINAL, original)
        st.save_file = save_file
        self.patched.append((st, "save_file", original))

    def report(self) -> Report:
        """What attention did since ``route``: every thread's calls, time, peak memory (CUDA)."""
        # torch's peak counters, never reset here (the trainer's own readings stay as they are): the
        # process's peak so far, which for a training process is the run's.
        vram = VramProbe(self.device).start().stop() if torch.cuda.is_available() else None
        return Report.from_recording(self.recording, seconds=time.perf_counter() - self.started, vram=vram)

    def log_report(self, final: bool = False) -> str:
        """One report line: to the training log (the handlers the trainer set up), else to stderr."""
        rank = os.environ.get("RANK")
        text = (f"attention{f' (rank {rank})' if rank is not None else ''}{' at the end' if final else ''}: "
                f"{summary(self.report())}")
        if _handled(log, logging.INFO):
            log.info("%s", text)
        else:
            print(f"lib_attn: {text}", file=sys.stderr, flush=True)
        return text

    def _every(self, seconds: float) -> None:
        while not self._halt.wait(seconds):
            try:
                self.log_report()
            except Exception as exc:  # noqa: BLE001 - a report must never stop training
                log.warning("attention report failed: %s", exc)

    def undo(self, report: bool = True) -> None:
        """Put every routed function back and remove the import hook; logs the final report."""
        if self.done:
            return
        self.done = True
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        if report:
            self.log_report(final=True)
        with self._lock:
            while self.patched:
                owner, name, original = self.patched.pop()
                setattr(owner, name, original)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self.recording.finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _handled(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``logger`` reaches a handler someone set up."""
    if not logger.isEnabledFor(level):
        return False
    while logger is not None:
        if logger.handlers:
            return True
        logger = logger.parent if logger.propagate else None
    return False


def route(report_every: float | None = None, **config) -> Routing:
    """Route sd-scripts' attention (see the module's docstring) until ``undo``. ``config``: the engine's
    configuration (``lib_attn.configure``'s arguments), set process-wide; ``report_every``: seconds
    between report lines in the log (None: only at the end)."""
    if config:
        configure(**config)
    return Routing(report_every)


def summary(report: Report) -> str:
    """The report in one log line: kernels x calls (recomputed), fallbacks, time, peak memory."""
    parts = []
    for role in report.roles():
        ran = []
        for backend, n in report.backends(role):
            again = report.recomputed.get((role, backend), 0)
            ran.append(f"{report.describe(backend)} {n - again} forward"
                       + (f" + {again} recomputed" if again else ""))
        parts.append(f"{role}: " + ", ".join(ran))
    text = "; ".join(parts) or "no attention calls"
    if report.fallbacks:
        text += "; fell back: " + ", ".join(f"{b} for {role} ({reason}) x{n}"
                                            for (role, b, reason), n in report.fallback_items())
    if report.seconds is not None:
        text += f"; {report.seconds:.1f} s"
    if report.vram is not None:
        text += f"; peak {report.vram.active_peak / MIB:.0f} MiB active, {report.vram.reserved_peak / MIB:.0f} MiB reserved"
    return text


# --- the launcher ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lib_attn.integrations.sd_scripts",
        description="Run an sd-scripts trainer with its attention routed through lib_attn. Engine options come "
                    "before the trainer's script; everything after it is the trainer's.")
    p.add_argument("--attn-backend", default=None, metavar="IDS",
                   help="backend ids in order of preference, comma-separated (default: auto)")
    p.add_argument("--attn-tune", choices=("auto", "on", "off"), default=None,
                   help="rank the kernels by measuring them on each call kind's first call (auto: on CUDA)")
    p.add_argument("--attn-guard", choices=("on", "off", "full"), default=None, help="the output guard's mode")
    p.add_argument("--attn-strict", action="store_true", help="raise instead of falling back")
    p.add_argument("--report-every", type=float, default=300.0, metavar="SECONDS",
                   help="seconds between report lines in the log (0: only at the end; default 300)")
    p.add_argument("script", help="the trainer, e.g. flux_train_network.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the trainer's own arguments")
    return p


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = {}
    if args.attn_backend:
        config["preference"] = [b.strip() for b in args.attn_backend.split(",") if b.strip()]
    if args.attn_tune:
        config["tune"] = args.attn_tune
    if args.attn_guard:
        config["guard"] = args.attn_guard
    if args.attn_strict:
        config["strict"] = True
    # No logging set-up here: sd-scripts' own (its console handler, --console_log_file) is made only where
    # the root logger has no handler yet, so the report joins whatever the trainer sets up.
    script = os.path.abspath(args.script)
    routing = route(args.report_every or None, **config)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args.args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        routing.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
