"""The dispatcher: a pure chain over the backends, decided once per call signature.

The decision path flows one way: ``spec`` (what a call is) -> ``kernels`` (each backend's reasons)
-> ``tune`` (ranking by measurement) -> ``guard`` (checking outputs) -> ``graph_op`` (the operator a
traced call becomes) -> this module, which uses them all and is used by none of them. ``attention``
is the engine's entry.

``decide`` walks a role's chain and returns the first backend whose reasons list is empty, keeping
every rejection. With tuning on, the first call of a signature asks ``tune`` to rank every backend of
the chain in force that takes it, and the fastest correct one is decided instead (``Decision.source``
says which way). ``attention`` caches the decision under the call's metadata, so the hot path does a
dict lookup, one countdown, one counter increment and the kernel call: no probing and no reason
strings. The countdown tells when the output guard (``guard``) looks at a call: a decision's first
call, then a sample of its calls (every call of an approximate kernel); a kernel whose output fails
loses the signature and the call is recomputed on the next backend.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from . import _compat
from . import check as _check
from . import config as _config
from . import graph_op
from . import guard as _guard
from . import schedule as _schedule
from . import stats
from . import tune as _tune
from .kernels import REGISTRY, Status, status
from .kernels.flash import CK_ARCHS, TRITON_ARCH_PREFIXES
from .kernels.base import failure_text, is_sticky
from .device import DeviceInfo
from .spec import CallSpec, spec_of, validate

log = logging.getLogger("lib_attn")


class AttentionFallbackError(RuntimeError):
    """Raised in strict mode when a call would not run on the backend the configuration put first."""


#: Default chains, fastest first, from published kernel measurements (see the README). The last
#: entry of every chain is ``math``, which takes every valid call.
_HOPPER_FIRST = ("sdpa-cudnn", "sdpa-flash", "xformers", "sdpa-efficient", "sdpa")
_AMPERE_FIRST = ("sdpa-flash", "sdpa-cudnn", "xformers", "sdpa-efficient", "sdpa")
_OLDER_GPU = ("xformers", "sdpa-efficient", "sdpa")
_GPU_VAE = ("sdpa-efficient", "xformers", "sdpa")
_OTHER_DEVICE = ("sdpa",)


#: PyTorch prefers cuDNN attention on Hopper/Blackwell-datacenter only from cuDNN 9.15.1, which fixed
#: sequence lengths that are not multiples of 128 (SD's 77-key cross-attention is one).
CUDNN_FIRST_FROM = 91501


#: Fused kernels first on an AMD GPU whose torch has AOTriton kernels for it (MI200/MI300, RDNA3/4):
#: flash-attn (its CK or Triton build) then PyTorch's AOTriton flash and memory-efficient kernels. cuDNN
#: does not exist there, and xformers' CK kernels are left to the user's choice (no published figure has
#: them ahead of AOTriton for these shapes).
_ROCM_FUSED = ("flash-attn", "sdpa-flash", "sdpa-efficient")
#: Above this many bytes of (b, h, q, kv) scores in the call's dtype, a call on a device with no fused
#: kernel for it runs on the bounded ``math`` path instead of a full-matrix kernel. At this size the full
#: matrix and its softmax hold >= 512 MiB at once (PyTorch's ROCm math path and MPS's sdpa_general_mps
#: both materialise them), which on an 8-16 GiB card or Mac sits on top of the model's own weights and
#: activations. The bounded path holds one 16 MiB score chunk at a time: measured on CPU (README),
#: 73 MiB for the VAE's 1024x1024 call and 72 MiB for SDXL's largest, output included, against 2.3 and
#: 2.9 GiB for PyTorch's full-matrix math kernel. In fp16, cross-attention, the lower UNet levels,
#: SDXL at 768x768, SD3 and Flux at 512x512 and the VAE up to 768x768 stay below it; the top UNet level
#: of SD1.5 at 512x512 (2 x 8 x 4096 x 4096 scores, 512 MiB), SDXL at 1024x1024 (640 MiB), SD3 and
#: Flux from 768x768 and the VAE at 1024x1024 (16384 x 16384, 512 MiB) are above it.
FULL_MATRIX_MAX_BYTES = 256 * 2**20


def score_bytes(spec: CallSpec) -> int:
    """Bytes of the call's full (b, h, q, kv) score matrix in its dtype."""
    return spec.batch * spec.heads * spec.q_len * spec.kv_len * (torch.finfo(spec.dtype).bits // 8)


def _rocm_chain(role: str, device: DeviceInfo, spec: CallSpec | None) -> tuple:
    """An AMD GPU: fused kernels where this torch (or flash-attn) has them; where none is, PyTorch's
    ``sdpa`` (its math kernel, a full score matrix) only for calls whose matrix is small."""
    # A large call no fused kernel takes (the VAE's head_dim 512 before AOTriton 0.9, or any call while
    # the experimental switch is off) goes to the bounded path: PyTorch's own choice would be the full matrix.
    tail = () if spec is not None and score_bytes(spec) > FULL_MATRIX_MAX_BYTES else ("sdpa",)
    first = _compat.AOTRITON_FIRST_TORCH.get(device.arch)
    if first is not None and _compat.TORCH_VERSION >= first:
        return _ROCM_FUSED + tail  # behind the experimental switch too: their reasons name it
    flash = ("flash-attn",) if device.arch.startswith(TRITON_ARCH_PREFIXES) or device.arch in CK_ARCHS else ()
    return flash + tail


def default_chain(role: str, device: DeviceInfo, fa3: bool | None = None, cudnn: int | None = -1,
                  spec: CallSpec | None = None) -> tuple:
    """The backends tried for ``role`` on ``device`` when the user chose none, in order.

    On Hopper (and sm10x) with a recent cuDNN, cuDNN and FlashAttention-3 are the fastest fused
    kernels, so cuDNN leads there, after flash-attn only when its FA3 build is installed (``fa3``;
    looked up when None). ``cudnn`` is the cuDNN version as torch reports it (looked up when -1).
    Elsewhere (Ampere, Ada, consumer Blackwell) flash-attn and PyTorch's flash kernel lead.
    SageAttention is never in a default chain: it is opt-in, because its 8-bit QK^T changes images
    on some models.

    On ROCm and MPS the chain also depends on the call's size (``spec``, from the call's metadata, so
    decided once per signature): see ``_rocm_chain`` and ``FULL_MATRIX_MAX_BYTES``. On MPS PyTorch's
    SDPA (``sdpa_general_mps``: matmul, softmax, matmul, all in MPSGraph; no fused kernel for
    these shapes) takes calls whose score matrix is at most that size, and the bounded path the rest:
    above it the matrix grows toward MPSGraph's 2**32-byte array limit (pytorch issue 149261) and its
    2**32-element indexing fault (pytorch issue 179352). Without ``spec`` the chain for a small call.
    """
    major = device.capability[0] if device.capability else 0
    if device.platform == "rocm":
        chain = _rocm_chain(role, device, spec)
    elif device.platform == "mps":
        chain = () if spec is not None and score_bytes(spec) > FULL_MATRIX_MAX_BYTES else _OTHER_DEVICE
    elif device.type != "cuda":
        chain = _OTHER_DEVICE
    elif role == "vae":
        chain = _GPU_VAE
    elif major in (9, 10) and (torch.backends.cudnn.version() if cudnn == -1 else cudnn or 0) >= CUDNN_FIRST_FROM:
        if fa3 is None:
            fa3 = status("flash-attn").available and REGISTRY["flash-attn"].fa3 is not None
        chain = ("flash-attn",) + _HOPPER_FIRST if fa3 else _HOPPER_FIRST[:1] + ("flash-attn",) + _HOPPER_FIRST[1:]
    elif major >= 8:
        chain = ("flash-attn",) + _AMPERE_FIRST
    else:
        chain = _OLDER_GPU
    return chain + ("math",)


def _dedupe(ids) -> tuple:
    seen: dict = {}
    for i in ids:
        seen.setdefault(i, None)
    return tuple(seen)


def chain_for(role: str, device: DeviceInfo, backend: str | None, cfg, spec: CallSpec | None = None) -> tuple[tuple, bool]:
    """The chain for one call and whether its head was named by the user (per call or configured)."""
    explicit = cfg.preference.get(role)
    head = ((backend,) if backend else ()) + (explicit or ())
    return _dedupe(head + _default(role, device, cfg, spec)), bool(head)


def _default(role: str, device: DeviceInfo, cfg, spec: CallSpec | None) -> tuple:
    """The default chain without the backends the configuration avoids."""
    chain = default_chain(role, device, spec=spec)
    return tuple(b for b in chain if b not in cfg.avoid) if cfg.avoid else chain


def tuning_chain(role: str, device: DeviceInfo, backend: str | None, cfg, spec: CallSpec | None = None) -> tuple | None:
    """The backends ranked for a call when tuning applies, else None.

    Under Auto, the default chain (never an ``approximate`` backend: those are ranked only where the
    user's chain names them); the user's own chain when it names more than one backend. A single
    named backend (per call or configured) is never second-guessed.
    """
    if backend is not None or not _tune.enabled(cfg.tune, device.type):
        return None
    named = cfg.preference.get(role)
    if named:
        return named if len(named) > 1 else None
    return tuple(b for b in _default(role, device, cfg, spec) if not REGISTRY[b].approximate)


@dataclass
class Decision:
    """What runs for a call signature. ``backend``: the id that runs; ``rejected``: (id, reasons) for
    every backend ahead of it in the chain; ``variant``: the package's kernel (e.g. "FA3");
    ``cast``: the dtype fp32 inputs are cast to, or None; ``preferred``: the backend the configuration
    put first (the first available one for a default chain); ``source``: how the backend was chosen,
    ``"measured"`` (tuning ranked the candidates on this call), ``"stored"`` (the ranking came from
    the tuning file) or ``"order"`` (the chain's fixed order); ``timings``: backend id -> median
    seconds of each candidate tuning ranked, fastest first (empty under ``"order"``). A candidate
    tuning rejected is in ``rejected`` with its reason (``output check failed: ...`` or its error), and
    so is one the guard rejected on this signature. ``checked``: the backend's output passed its check
    on this signature (or needs none); ``countdown``: calls before the guard looks at one."""

    backend: str
    rejected: list = field(default_factory=list)
    variant: str = ""
    cast: torch.dtype | None = None
    preferred: str | None = None
    spec: CallSpec | None = None
    run: object = field(default=None, repr=False)
    count_key: tuple = ()
    fallback_key: tuple | None = None
    source: str = "order"
    timings: dict = field(default_factory=dict)
    final: bool = field(default=True, repr=False)  # False: decided where tuning was blocked, not cached
    checked: bool = field(default=True, repr=False)
    countdown: int = field(default=_guard.NEVER, repr=False)
    late: object = field(default=None, repr=False)  # the guard's device-side count (CUDA, mode on)
    #: The counters of ``count_key`` and ``fallback_key`` (and of the fallback's whole path: every
    #: backend passed over and the one that ran): the hot path counts with one increment each.
    call_cell: object = field(default=None, init=False, repr=False, compare=False)
    fallback_cell: object = field(default=None, init=False, repr=False, compare=False)
    path_cell: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.call_cell = stats.call_cell(self.count_key) if self.count_key else None
        self.fallback_cell = None if self.fallback_key is None else stats.fallback_cell(self.fallback_key)
        if self.fallback_key is not None:
            others = tuple((bid, "; ".join(r)) for bid, r in self.rejected if bid != self.preferred)
            self.path_cell = stats.path_cell((self.fallback_key, others, self.backend))

    @property
    def fallback(self) -> bool:
        return self.fallback_key is not None

    def reasons_for(self, backend_id: str) -> list:
        for bid, reasons in self.rejected:
            if bid == backend_id:
                return reasons
        return []

    def __str__(self) -> str:
        lines = [f"{self.backend}{f' ({self.variant})' if self.variant else ''}"
                 f"{f', inputs cast to {self.cast}' if self.cast else ''}"]
        if self.source != "order":
            lines[0] += f" [tuned: {self.source}]"
        lines += [f"  {bid}: median {_tune.ms_text(t)}" for bid, t in self.timings.items()]
        lines += [f"  passed over {bid}: {'; '.join(reasons)}" for bid, reasons in self.rejected]
        return "\n".join(lines)


def _verdict(spec: CallSpec, bid: str, st: Status, fp32: str, asked: bool, failed: dict | None,
             excluded: dict | None = None):
    """(reasons, cast, run_spec) of one backend for ``spec``; no reasons means it takes the call."""
    if not st.available:
        return [f"not available: {st.reason}"], None, spec
    if failed and bid in failed:
        return [f"failed at run time: {failed[bid]}"], None, spec
    if excluded and bid in excluded:
        return [excluded[bid]], None, spec
    backend = REGISTRY[bid]
    cast, run_spec = None, spec
    if spec.dtype == torch.float32 and fp32 == "cast" and not backend.takes_dtype(torch.float32, spec.device.type):
        cast = spec.device.half_dtype
        run_spec = spec.with_dtype(cast)
    reasons = backend.reasons(run_spec, asked=asked)
    if fp32 == "keep" and spec.dtype == torch.float32:
        reasons = [r + " (fp32 policy: keep)" if r.startswith("dtype") else r for r in reasons]
    return reasons, cast, run_spec


def _preferred(chain, statuses: dict | None, explicit: bool) -> str | None:
    if explicit:
        return chain[0]
    return next((bid for bid in chain if (statuses[bid] if statuses is not None else status(bid)).available), None)


def decide(spec: CallSpec, chain, statuses: dict | None = None, fp32: str = "cast", explicit: bool = False,
           failed: dict | None = None, excluded: dict | None = None) -> Decision:
    """Walk ``chain`` for ``spec`` and return the first backend that takes it.

    ``statuses`` maps ids to probe results (the real probes when None); ``explicit`` says the chain's
    head was named by the user, so its first entry is the preferred one even when not installed;
    ``failed`` maps ids to a run-time failure that demoted them for this signature; ``excluded``
    maps ids to the reason tuning rejected them for it.
    """
    rejected = []
    preferred = _preferred(chain, statuses, explicit)
    for bid in chain:
        st: Status = statuses[bid] if statuses is not None else status(bid)
        reasons, cast, run_spec = _verdict(spec, bid, st, fp32, explicit and bid == chain[0], failed, excluded)
        if reasons:
            rejected.append((bid, reasons))
            continue
        return _decision(REGISTRY[bid], rejected, cast, preferred, spec, run_spec)
    raise ValueError(f"no backend takes this call ({spec.describe()}): "
                     + "; ".join(f"{bid}: {', '.join(r)}" for bid, r in rejected))


def decide_tuned(spec: CallSpec, chain, pool, fp32: str, explicit: bool, failed: dict | None,
                 inputs: tuple | None, excluded: dict | None = None) -> Decision | None:
    """Rank the backends of ``pool`` that take ``spec`` (``tune.rank``) and decide the fastest correct
    one; None when none takes it or nothing is stored and ``inputs`` is None. ``chain`` is the full
    chain in force, ``inputs`` the call's (q, k, v, mask, scale) to measure on; ``excluded`` as for
    ``decide``."""
    rejected, takers = [], {}
    for bid in pool:
        reasons, cast, run_spec = _verdict(spec, bid, status(bid), fp32, explicit and bid == chain[0], failed,
                                           excluded)
        if reasons:
            rejected.append((bid, reasons))
        else:
            takers[bid] = (REGISTRY[bid], cast, run_spec)
    if not takers:
        return None
    candidates = [_tune.Candidate(bid, _wrap(b.runner(rs), spec.layout != b.layout, cast), cast or spec.dtype,
                                  b.approximate) for bid, (b, cast, rs) in takers.items()]
    ranking = _tune.rank(spec, fp32, candidates, inputs)
    if ranking is None:
        return None
    if ranking.winner is None:  # every candidate failed its check: the rest of the chain, in order
        try:
            return decide(spec, chain, fp32=fp32, explicit=explicit, failed=failed,
                          excluded={**(excluded or {}), **ranking.rejected})
        except ValueError:  # nothing left: a check must never stop a generation that ran without it
            return decide(spec, chain, fp32=fp32, explicit=explicit, failed=failed)
    rejected += [(bid, [reason]) for bid, reason in ranking.rejected.items()]
    preferred = _preferred(chain, None, explicit)
    if preferred in ranking.timings:
        preferred = ranking.winner  # it took the call and passed its check: being slower is no fallback
    backend, cast, run_spec = takers[ranking.winner]
    dec = _decision(backend, rejected, cast, preferred, spec, run_spec, ranking.source)
    dec.timings = dict(ranking.timings)
    return dec


def _decision(backend, rejected, cast, preferred, spec, run_spec, source: str = "order") -> Decision:
    variant = backend.variant(run_spec)
    run = _wrap(backend.runner(run_spec), spec.layout != backend.layout, cast)
    fallback_key = None
    if preferred is not None and preferred != backend.id:
        reasons = next((r for bid, r in rejected if bid == preferred), [])
        fallback_key = (spec.role, preferred, "; ".join(reasons))
    stats.note_kernel(backend.id, " ".join(p for p in (backend.id, status(backend.id).version, f"({variant})" if variant else "") if p))
    if source != "order":
        stats.note_tuned(spec.role, backend.id)
    # The decision outlives the call: it must not keep the call's tensors alive.
    spec = replace(spec, tensors=None)
    dec = Decision(backend.id, rejected, variant, cast, preferred, spec, run, (spec.role, backend.id, spec.rule),
                   fallback_key, source)
    # Tuning checked what it ranked; anything else is checked on its first call, once per process
    # (decisions are dropped at every configuration change, which a webui makes per generation).
    dec.checked = source != "order" or (backend.id, spec) in _trusted
    dec.countdown = _guard.countdown(_config.current().guard, backend.id, backend.approximate, dec.checked)
    return dec


def _wrap(run, transpose: bool, cast):
    """Adapt a backend's kernel call to the caller's layout and dtype; the common case adds nothing."""
    if not transpose and cast is None:
        return run
    if cast is None:
        def run_transposed(q, k, v, mask, scale):
            return run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale).transpose(1, 2)
        return run_transposed

    def run_cast(q, k, v, mask, scale):
        dtype = q.dtype
        if transpose:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = run(q.to(cast), k.to(cast), v.to(cast), mask, scale).to(dtype)
        return out.transpose(1, 2) if transpose else out
    return run_cast


# --- the hot path -----------------------------------------------------------------------------

_cache: dict = {}
_failed: dict = {}  # signature key -> {backend id: failure text}
_trusted: set = set()  # (backend id, CallSpec) whose output passed the guard's first check
_reported: set = set()


def _forget() -> None:
    _cache.clear()


_config.on_change(_forget)


_grad_enabled = torch.is_grad_enabled
_compiling = _compat.IS_COMPILING
_where = _schedule.where


def _key(q, k, v, mask, layout, role, backend, fp32):
    """Everything a decision depends on, read from metadata only. Strides are not in it (every
    backend takes strided views); k's and v's devices are read as their index, which is cheaper and,
    with q's full device, tells a mixed call from a valid one. The schedule's token (None without a
    schedule) says which of its rules hold where sampling is. ``attention`` inlines the same tuple:
    keep the two in step."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
            mask if mask is None else (mask.shape, mask.dtype, mask.get_device()),
            _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
            _where.token, layout, role, backend, fp32)


def _scheduled(cfg, spec: CallSpec):
    """(configuration, spec) for a call under the schedule in force: the first rule that takes the call
    puts its chain in force for the call's role, and the spec says which rule served it."""
    if cfg.schedule is None:
        return cfg, spec
    rule = _schedule.rule_for(cfg.schedule, _where.token, spec.role, spec.q_len, spec.kv_len)
    spec = replace(spec, rule=(cfg.schedule.text, rule.label if rule is not None else _schedule.OTHERWISE))
    return _with_rule(cfg, spec.role, rule), spec


def _for_rule(cfg, spec: CallSpec):
    """The configuration in force for a call the schedule's rule ``spec.rule`` served."""
    rule = cfg.schedule.rule(spec.rule[1]) if spec.rule is not None and cfg.schedule is not None else None
    return _with_rule(cfg, spec.role, rule)


def _with_rule(cfg, role: str, rule):
    """``cfg`` with ``rule``'s chain for ``role`` (the configuration itself when no rule applies)."""
    return cfg if rule is None else replace(cfg, preference={**cfg.preference, role: rule.chain})


def _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, measure=True) -> Decision:
    """Validate a call and decide for it; ``key`` is its signature (None when it has none).
    ``measure``: tuning may run kernels on this call's inputs (not for ``explain``)."""
    validate(q, k, v, mask, layout, role, scale)
    if backend is not None and backend not in REGISTRY:
        raise ValueError(f"unknown backend id {backend!r}; valid ids: {', '.join(REGISTRY)}")
    if fp32 is not None and fp32 not in _config.FP32_POLICIES:
        raise ValueError(f"fp32 policy {fp32!r} is not one of {', '.join(_config.FP32_POLICIES)}")
    cfg, spec = _scheduled(_config.current(), spec_of(q, k, v, mask, layout, role))
    chain, explicit = chain_for(role, spec.device, backend, cfg, spec)
    fp32 = fp32 or cfg.fp32
    excluded = _guarded_out(spec, fp32, cfg)
    pool = tuning_chain(role, spec.device, backend, cfg, spec)
    if pool:
        if _tune.blocked(spec.device.type):
            # Tracing, capture or backward: the fixed order serves this call, and is not cached, so
            # that the signature's first ordinary call still tunes.
            dec = decide(spec, chain, fp32=fp32, explicit=explicit, failed=_failed.get(key), excluded=excluded)
            dec.final = False
            return dec
        inputs = (q, k, v, mask, scale) if measure and key is not None else None
        dec = decide_tuned(spec, chain, pool, fp32, explicit, _failed.get(key), inputs, excluded)
        if dec is not None:
            return dec
    return decide(spec, chain, fp32=fp32, explicit=explicit, failed=_failed.get(key), excluded=excluded)


def _guarded_out(spec: CallSpec, fp32: str, cfg) -> dict | None:
    """The backends whose output failed its check on this signature on this machine, with the reason
    (none while the guard is off): they do not get the signature."""
    if cfg.guard == "off":
        return None
    return {bid: reason for bid, reason in _tune.rejections(spec, fp32).items() if bid != "math"} or None


def explain(q, k, v, *, layout="bhsd", mask=None, scale=None, role="unet", backend=None, fp32=None) -> Decision:
    """The decision ``attention`` would take for this call, without running a kernel.

    After the signature's first call this is the cached decision. Before it, with tuning on, it is
    the stored ranking when the tuning file has one, else the fixed order (``source == "order"``).
    """
    try:
        key = _key(q, k, v, mask, layout, role, backend, fp32)
        found = _cache.get(key)
    except (AttributeError, TypeError, IndexError, RuntimeError):
        key = found = None
    return found or _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key, measure=False)


def attention(q, k, v, *, layout="bhsd", mask=None, scale=None, role="unet", backend=None, fp32=None):
    """Attention over q, k, v on the fastest backend that takes the call, falling back per call.

    q: (b, h, q_len, d), k and v: (b, h, kv_len, d) in layout ``"bhsd"``; (b, seq, h, d) in ``"bshd"``.
    Strided views are fine. ``mask`` follows F.scaled_dot_product_attention (bool: True takes part;
    float: added to the scores), broadcastable to (b, h, q_len, kv_len). ``scale`` defaults to
    1/sqrt(d). ``role`` (unet, dit, vae, text) selects the chain; ``backend`` puts one id first for
    this call; ``fp32`` ("cast"/"keep") overrides the fp32 policy for this call.
    Returns (b, h, q_len, d) or (b, q_len, h, d) as the input, in q's dtype.

    Under torch.compile the call is one opaque operator (``traced``), decided when it runs.
    """
    if _compiling():
        return traced(q, k, v, mask, layout, scale, role, backend, fp32)
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.get_device(), v.get_device(),
               mask if mask is None else (mask.shape, mask.dtype, mask.get_device()),
               _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
               _where.token, layout, role, backend, fp32)
        dec = _cache[key]
    except KeyError:
        dec = _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key)
        if dec.final:
            _cache[key] = dec
    except (AttributeError, TypeError, RuntimeError):  # not tensors (or an unhashable argument)
        key = None
        dec = _decide_call(q, k, v, mask, layout, role, backend, fp32, scale, key)
    if dec.fallback_cell is not None:
        _on_fallback(dec)
    dec.countdown -= 1
    if dec.countdown < 0:
        return _guarded(key, dec, q, k, v, mask, scale)
    try:
        out = dec.run(q, k, v, mask, scale)
    except Exception as exc:  # noqa: BLE001 - sorted by _recover: only recoverable kinds fall back
        return _recover(key, dec, exc, q, k, v, mask, scale)
    dec.call_cell.n += 1
    return out


def _call(key, dec: Decision, q, k, v, mask, scale):
    """``attention``'s work after the decision (which it inlines): the guard when it is due, else the kernel."""
    dec.countdown -= 1
    if dec.countdown < 0:
        return _guarded(key, dec, q, k, v, mask, scale)
    return _run(key, dec, q, k, v, mask, scale)


def _run(key, dec: Decision, q, k, v, mask, scale):
    """The kernel and the count; a failure goes to ``_recover``."""
    try:
        out = dec.run(q, k, v, mask, scale)
    except Exception as exc:  # noqa: BLE001 - as in attention
        return _recover(key, dec, exc, q, k, v, mask, scale)
    dec.call_cell.n += 1
    return out


def _guarded(key, dec: Decision, q, k, v, mask, scale):
    """A call the guard looks at (see ``guard``): checked against the reference when it is the
    decision's first (or the mode is ``full``), else screened for non-finite values."""
    mode = _config.current().guard
    device = dec.spec.device.type
    backend = REGISTRY[dec.backend]
    if _tune.blocked(device):  # tracing, capture, backward: nothing may be read; the next call is looked at
        dec.countdown = 0
        return _run(key, dec, q, k, v, mask, scale)
    late = 0
    try:
        if not dec.checked or mode == "full":
            out, reason = _guard.first_check(dec.run, q, k, v, mask, scale, dec.spec.layout,
                                             dec.cast or dec.spec.dtype, backend.approximate, probe=not dec.checked)
        else:
            out = dec.run(q, k, v, mask, scale)
            reason = _check.shape_mismatch(out, q.shape)
            if not reason and mode == "on" and device in _guard.DEFERRED:
                if dec.late is None:
                    dec.late = _guard.LateCount(q.device)
                late = dec.late.add(out, q, k, v)
                reason = f"{_check.CHECK_FAILED}: {_guard.NON_FINITE}" if late else ""
            elif not reason and _guard.non_finite_blame(out, q, k, v, mask, scale, dec.spec.layout):
                reason = f"{_check.CHECK_FAILED}: {_guard.NON_FINITE}"
    except Exception as exc:  # noqa: BLE001 - as in attention
        return _recover(key, dec, exc, q, k, v, mask, scale)
    if reason.startswith(_guard.UNCHECKED):
        # No memory to check it: this call runs as it is, and the decision's next call is checked.
        _unchecked_once(dec, reason)
        dec.countdown = 0
        dec.call_cell.n += 1
        return out
    if not reason:
        if not dec.checked:
            _trusted.add((dec.backend, dec.spec))
        dec.checked = True
        dec.countdown = _guard.countdown(mode, dec.backend, backend.approximate, True)
        dec.call_cell.n += 1
        return out
    del out
    return _caught(key, dec, reason, late, q, k, v, mask, scale)


def _unchecked_once(dec: Decision, reason: str) -> None:
    if (dec.backend, dec.spec) not in _reported:
        _reported.add((dec.backend, dec.spec))
        log.warning("attention guard: %s could not be checked on %s, %s; that call ran unchecked, the next one "
                    "is checked", dec.backend, _guard.spec_text(dec.spec), reason)


def _caught(key, dec: Decision, reason: str, late: int, q, k, v, mask, scale):
    """The guard caught ``dec.backend``'s output: the backend loses the signature (here and in the
    tuning file) and the call is recomputed on the next backend. ``late``: earlier calls found
    faulty after they had returned (CUDA, mode on), which nothing can recompute."""
    spec = dec.spec
    cfg = _for_rule(_config.current(), spec)
    short = _guard.short(reason)
    # A fault found while watching a trusted kernel, or its rejection before it was trusted.
    text = short if dec.checked and short == _guard.NON_FINITE else f"rejected for {_guard.spec_text(spec)}: {short}"
    if cfg.strict:
        raise AttentionFallbackError(f"strict mode: guard: {dec.backend} {text}; it would be recomputed on the next "
                                     "backend")
    layout, role, backend, fp32 = key[-4:] if key is not None else (spec.layout, spec.role, None, None)
    fp32 = fp32 or cfg.fp32
    _tune.reject(spec, fp32, dec.backend, reason)
    _trusted.discard((dec.backend, spec))
    for other, cached in list(_cache.items()):  # every cached decision of this kernel for this signature
        if cached.backend == dec.backend and cached.spec == spec:
            _cache.pop(other, None)
    chain, explicit = chain_for(role, spec.device, backend, cfg, spec)
    new = decide(replace(spec_of(q, k, v, mask, layout, role), rule=spec.rule), chain, fp32=fp32, explicit=explicit,
                 failed=_failed.get(key), excluded=_guarded_out(spec, fp32, cfg))
    if key is not None:
        _cache[key] = new
    log.warning("attention guard: %s %s; recomputed on %s%s", dec.backend, text, new.backend,
                f" ({late} earlier call(s) found faulty after they had returned)" if late else "")
    if late:
        stats.count_guard((role, dec.backend, text, new.backend, False), late)
    else:
        stats.count_guard((role, dec.backend, text, new.backend, True))
    if new.fallback_cell is not None:
        new.fallback_cell.n += 1
        new.path_cell.n += 1
        _report_once(new.fallback_key, new.backend)
    return _call(key, new, q, k, v, mask, scale)


#: What a call traced by torch.compile becomes: the ``lib_attn::attention`` operator, which runs
#: ``attention`` when the compiled graph runs.
traced = graph_op.operator(attention)


def _on_fallback(dec: Decision) -> None:
    if _config.current().strict:
        role, preferred, reasons = dec.fallback_key
        raise AttentionFallbackError(
            f"strict mode: {preferred} cannot take this {role} call ({dec.spec.describe()}): {reasons}; "
            f"it would run on {dec.backend}")
    dec.fallback_cell.n += 1
    dec.path_cell.n += 1
    _report_once(dec.fallback_key, dec.backend)


def _report_once(fallback_key: tuple, ran_on: str) -> None:
    role, preferred, reasons = fallback_key
    if (preferred, reasons) not in _reported:
        _reported.add((preferred, reasons))
        log.warning("attention: %s passed over for %s calls (%s); running %s instead", preferred, role, reasons, ran_on)


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def _recover(key, dec: Decision, exc: Exception, q, k, v, mask, scale):
    """A kernel failed: demote it for this signature and rerun on the next backend, or re-raise."""
    # Bad input that shares a cached signature with good input (the key reads k's and v's device
    # index, not their full device) must surface as the ValueError it is, never demote a backend.
    validate(q, k, v, mask, dec.spec.layout, dec.spec.role, scale)
    if _is_oom(exc):
        # The VAE's single 512-wide head is the one call whose memory grows with the image: retry it
        # on the bounded path. Elsewhere an OOM is the host's to handle, as without this extension.
        if dec.spec.role != "vae" or dec.backend == "math":
            raise exc
        fallback_key = (dec.spec.role, dec.backend, "out of memory")
        if _config.current().strict:
            raise AttentionFallbackError(f"strict mode: {dec.backend} ran out of memory on a vae call") from exc
        stats.count_fallback(fallback_key)
        stats.path_cell((fallback_key, (), "math")).n += 1
        _report_once(fallback_key, "math")
        out = _wrap(REGISTRY["math"].run, dec.spec.layout != "bhsd", None)(q, k, v, mask, scale)
        stats.count_call((dec.spec.role, "math", dec.spec.rule))
        return out
    sticky = is_sticky(exc)
    recoverable = isinstance(exc, (RuntimeError, NotImplementedError, ValueError, TypeError, AssertionError))
    if sticky or not recoverable or dec.backend == "math" or key is None:
        raise exc
    text = failure_text(exc)
    if _config.current().strict:
        raise AttentionFallbackError(f"strict mode: {dec.backend} failed on {dec.spec.describe()}: {text}") from exc
    failed = _failed.setdefault(key, {})
    failed[dec.backend] = text
    cfg = _for_rule(_config.current(), dec.spec)
    layout, role, backend, fp32 = key[-4:]
    chain, explicit = chain_for(role, dec.spec.device, backend, cfg, dec.spec)
    # A fresh spec carries this call's tensors, so PyTorch's own checks speak for the next backend.
    new = decide(replace(spec_of(q, k, v, mask, layout, role), rule=dec.spec.rule), chain, fp32=fp32 or cfg.fp32,
                 explicit=explicit, failed=failed, excluded=_guarded_out(dec.spec, fp32 or cfg.fp32, cfg))
    _cache[key] = new
    if new.fallback_cell is not None:
        new.fallback_cell.n += 1
        new.path_cell.n += 1
        _report_once(new.fallback_key, new.backend)
    return _call(key, new, q, k, v, mask, scale)  # the next backend may fail too: same rules


def reset() -> None:
    """Forget decisions, demotions, tuned marks and the once-only log record (tests)."""
    _cache.clear()
    _failed.clear()
    _trusted.clear()
    _reported.clear()
    stats.forget_tuned()
