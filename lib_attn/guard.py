"""The output guard: a kernel's output is checked before it is trusted, and watched while it runs.

A kernel that returns NaN or a wrong answer raises nothing, so catching exceptions does not find it.
The dispatcher (``dispatch``) asks this module to look at a call's output:

* **Checked before trusted.** The first call of each call signature on each kernel runs on copies of
  q, k and v and is checked like a tuning candidate (``tune.reference`` on at most ``tune.CHECK_ROWS``
  query rows, ``tune.check`` with the dtype's bound, four times looser for an ``approximate``
  kernel), and the copies are compared with the inputs bit for bit: a kernel that wrote into them
  fails too. Whoever chose the kernel (Auto, a chain, a single name): a kernel that tuning checked on
  this signature (``Decision.source`` not ``"order"``) is not checked again, and the engine's own
  ``math`` is the reference itself.
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
chain, the event is counted (``stats.count_guard``), and the rejection is kept in the tuning file
under the machine's fingerprint (``tune.reject``), so the next start skips it. Strict mode raises
instead.
"""
from __future__ import annotations

import logging
import math

import torch

from . import tune as _tune
from .kernels.base import DTYPE_NAMES, failure_text, is_sticky

log = logging.getLogger("lib_attn")

#: In mode ``on``, one call in this many of an exact kernel has its output screened.
SAMPLE_EVERY = 64
#: The countdown of a decision whose calls the guard does not look at.
NEVER = 1 << 62
#: Devices whose screen in mode ``on`` is read later from a device-side count, never waited for.
DEFERRED = ("cuda",)
NON_FINITE = "non-finite values"
WROTE_INPUTS = "wrote into its inputs"

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    prefix = _tune.CHECK_FAILED + ": "
    return reason[len(prefix):] if reason.startswith(prefix) else reason


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals itself)."""
    as_int = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.detach().view(as_int), b.detach().view(as_int))


def checked_call(run, q, k, v, mask, scale, layout: str, dtype, approximate: bool):
    """Run ``run`` on copies of q, k, v and check it: (output, "" or the reason it fails). ``dtype``:
    what the kernel computes in. The kernel's own exceptions propagate."""
    rows = _tune.check_rows(q.shape[1] if layout == "bshd" else q.shape[2])
    try:
        with torch.no_grad():
            ref = _tune.reference(q, k, v, mask, scale, layout, rows)
    except Exception as exc:  # noqa: BLE001 - e.g. no memory left for it: the check, not the kernel, failed
        if is_sticky(exc):
            raise
        log.warning("attention guard: could not check a call (%s); it runs unchecked", failure_text(exc))
        return run(q, k, v, mask, scale), ""
    copies = tuple(t.clone() for t in (q, k, v))
    out = run(*copies, mask, scale)
    with torch.no_grad():
        if not all(_same_bits(c, t) for c, t in zip(copies, (q, k, v))):
            return out, f"{_tune.CHECK_FAILED}: {WROTE_INPUTS}"
        return out, _tune.check(out, q.shape, layout, rows, ref, _tune.bound(dtype, q.device.type, approximate))


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
        rows = _tune.check_rows(q.shape[1] if layout == "bshd" else q.shape[2])
        return bool(torch.isfinite(_tune.reference(q, k, v, mask, scale, layout, rows)).all())


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
