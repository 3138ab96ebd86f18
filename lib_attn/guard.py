"""The output guard: a kernel's output is checked before it is trusted, and watched while it runs.

A kernel that returns NaN or a wrong answer raises nothing, so catching exceptions does not find it.
The dispatcher (``dispatch``) asks this module to look at a call's output:

* **Checked before trusted.** The first call of each call signature on each kernel is checked
  (``first_check``) without copying the call: the kernel first runs on ``check.probe``'s copies of a
  part of it (the whole call when small; else one batch item and head, each sequence cut to at most
  ``check.PROBE_BYTES`` for q, k and v together), which are then compared with the caller's tensors
  bit for bit. Only a kernel that left them alone then runs on the caller's tensors (when the part
  is not the whole call), watched by ``check.Watch`` (fingerprints before and after, copies in host
  memory that put the caller's tensors back should it write into them), and the
  call's output is checked against ``check.reference`` on ``check.samples``' rows, with the dtype's
  bound, four times looser for an ``approximate`` kernel. Whoever chose the kernel
  (Auto, a chain, a single name): a kernel that tuning checked on this signature
  (``Decision.source`` not ``"order"``) is not checked again, and the engine's own ``math`` is the
  reference itself. A check that cannot be made (no memory for it) is skipped for that call, with
  a log line: the call runs, and the next one is checked.
* **Watched while it runs.** After that check, an approximate kernel's output is screened for
  non-finite values (and its shape) on every call, an exact kernel's on one call in ``SAMPLE_EVERY``.
  A screen that finds one first looks at the inputs: non-finite inputs (or a reference that is
  non-finite on them) are the model's doing, not the kernel's, and pass as they are.
* **Where a GPU would wait.** Reading a screen's result on the host waits for the GPU to finish the
  call. On CUDA, mode ``on`` never does: each screened call adds its verdict to a counter on the
  device (``LateCount``) and queues a copy of it into pinned host memory behind a CUDA event; a later
  screened call reads the copy only once the event says it has landed. A fault is then found one
  screened call (or a few) late: the call that shows it cannot be recomputed (its output has been
  returned), the call in hand is recomputed on the next backend, and the signature is demoted from
  then on. Mode ``full`` checks every call against the reference at once, as the first call is
  checked: one synchronisation per call on a GPU, every faulty output recomputed. On the CPU (and
  other devices) the screen is read at once: every fault it finds is recomputed.

A kernel that fails loses that signature: the call is recomputed with the next backend of the
chain, the event is counted (``stats.count``), and the rejection is kept in the tuning file
under the machine's fingerprint (``tune.reject``), so the next start skips it. Strict mode raises
instead.
"""
from __future__ import annotations

import logging
import math

import torch

from . import check as _check
from .kernels.base import DTYPE_NAMES, failure_text, is_sticky, needs_grad

log = logging.getLogger("lib_attn")

#: In mode ``on``, one call in this many of an exact kernel has its output screened.
SAMPLE_EVERY = 64
#: The countdown of a decision whose calls the guard does not look at.
NEVER = 1 << 62
#: Devices whose screen in mode ``on`` is read later from a device-side count, never waited for.
DEFERRED = ("cuda",)
NON_FINITE = "non-finite values"
#: The start of a verdict that says the check could not be made.
UNCHECKED = "not checked"


def countdown(mode: str, backend_id: str, approximate: bool, checked: bool) -> int:
    """Calls a decision runs before the guard looks at the next one."""
    if mode == "off" or backend_id == "math":
        return NEVER
    if mode == "full" or not checked or approximate:
        return 0
    return SAMPLE_EVERY - 1


def spec_text(spec) -> str:
    """A call signature for people: ``unet 2×8×4096×77×40 fp16``."""
    dims = "×".join(map(str, (spec.batch, spec.heads, spec.q_len, spec.kv_len, spec.head_dim)))
    return f"{spec.role} {dims} {DTYPE_NAMES.get(spec.dtype, spec.dtype_name)}"


def short(reason: str) -> str:
    """A check's reason without its common start: ``rel err 2.8e-01 > 8.0e-02``."""
    prefix = _check.CHECK_FAILED + ": "
    return reason[len(prefix):] if reason.startswith(prefix) else reason


def first_check(run, q, k, v, mask, scale, layout: str, dtype, approximate: bool, probe: bool = True):
    """Run ``run`` for the call and check it: (output or None, verdict). The verdict is "" (passed),
    the reason it failed, or one starting with ``UNCHECKED`` when the check could not be made (no
    memory for it): the output is then the call's, unchecked. ``dtype``: what the kernel computes in.

    With ``probe``, the kernel first runs on ``check.probe``'s copies of a part of the call, and only
    once those are seen unchanged does it run on the caller's tensors (when the part is not the whole
    call), watched by ``check.Watch`` (on a first check, with copies that undo a write). The output
    for the call is checked on
    ``check.samples``' rows. The kernel's own exceptions propagate."""
    limit = _check.bound(dtype, q.device.type, approximate)
    # The checks run without grad; the call itself runs in the caller's grad mode, so that its output
    # keeps the autograd graph a training step needs (a probe's output, made from copies, never has it).
    caller_grad = torch.is_grad_enabled()
    graph = needs_grad(q, k, v, mask)

    def call():
        with torch.set_grad_enabled(caller_grad):
            return run(q, k, v, mask, scale)

    with torch.no_grad():
        if probe:
            try:
                part = _check.probe(q, k, v, mask, layout)
            except Exception as exc:  # noqa: BLE001 - e.g. no memory left for it: the check failed, not the kernel
                return call(), _unchecked(exc)
            out = run(*part.args, scale)
            if not part.untouched():
                return None, f"{_check.CHECK_FAILED}: {_check.WROTE_INPUTS}"
            if part.whole and not graph:
                return out, _checked(out, q, k, v, mask, scale, layout, limit)
            del out, part
        try:
            watch = _check.Watch((q, k, v), keep=probe)
        except Exception as exc:  # noqa: BLE001 - as above
            return call(), _unchecked(exc)
        history = [t.grad_fn for t in (q, k, v)] if graph else None
        out = call()
        if watch.changed():
            reason = watch.undo()
            if graph and any(t.requires_grad and t.grad_fn is not g for t, g in zip((q, k, v), history)):
                reason = _check.WROTE_THROUGH_AUTOGRAD
            return out, f"{_check.CHECK_FAILED}: {reason}"
        return out, _checked(out, q, k, v, mask, scale, layout, limit)


def _checked(out, q, k, v, mask, scale, layout: str, limit: float) -> str:
    """``check.check``'s verdict on ``out`` for the call q, k, v; ``UNCHECKED`` when it cannot be made."""
    try:
        rows = _check.samples(q, layout)
        return _check.check(out, q.shape, layout, rows, _check.reference(q, k, v, mask, scale, layout, rows), limit)
    except Exception as exc:  # noqa: BLE001 - e.g. no memory left for the reference
        return _unchecked(exc)


def _unchecked(exc: Exception) -> str:
    if is_sticky(exc):
        raise exc
    return f"{UNCHECKED} ({failure_text(exc)})"


def non_finite_blame(out, q, k, v, mask, scale, layout: str) -> bool:
    """True when ``out`` has a non-finite value the kernel is to blame for: the inputs are finite and
    so is the reference on the checked rows (a fully masked row is non-finite in every kernel)."""
    with torch.no_grad():
        # The sum is the cheap screen (2 µs on a tiny CPU call, against 9 for isfinite().all()): it is
        # finite unless an element is not, or it overflows fp32, which isfinite() then tells apart.
        if math.isfinite(float(out.sum(dtype=torch.float32))) or bool(torch.isfinite(out).all()):
            return False
        if not all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
            return False
        rows = _check.samples(q, layout)
        return bool(torch.isfinite(_check.reference(q, k, v, mask, scale, layout, rows)).all())


class LateCount:
    """Outputs with non-finite values (from finite inputs), counted on the device and read on the
    host once a copy has landed, so that screening never waits for the device."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.count = torch.zeros((), dtype=torch.int32, device=device)
        self.host = torch.zeros((), dtype=torch.int32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False
        self.seen = 0

    def add(self, out, q, k, v) -> int:
        """Queue the screen of this call; the number of faulty earlier calls found now (0 while the
        last copy is still in flight)."""
        found = 0
        if self.pending and (self.event is None or self.event.query()):
            total = int(self.host)
            found, self.seen, self.pending = total - self.seen, total, False
        with torch.no_grad():
            f32 = torch.float32
            # A sum is non-finite when an element is (or when it overflows fp32, which an output,
            # a convex mix of v, cannot; inputs that do are left alone, as non-finite ones are).
            inputs = q.sum(dtype=f32) + k.sum(dtype=f32) + v.sum(dtype=f32)
            self.count += torch.isfinite(inputs) & ~torch.isfinite(out.sum(dtype=f32))
        if not self.pending:
            self.host.copy_(self.count, non_blocking=True)
            if self.event is not None:
                self.event.record()
            self.pending = True
        return found
