"""The report of one stretch of work (a generation, a graph run) as data: which kernels ran, how
often, what fell back and why, time, peak memory, notes; and its JSON.

Built from a ``Recording`` plus a memory reading. Its text is the hosts' to write
(``lib_attn.readout``, and the webuis' readout and infotext on top of it): nothing here is text
for people but a kernel's description. Nothing here imports a host module, and CUDA is touched only
by ``VramProbe`` on a CUDA device.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from .schedule import OTHERWISE, parse
from .sparse_report import SparseReport

MIB = 1024 * 1024

#: Order of the roles wherever a report lists them: the denoiser first, then the VAE, then the rest.
ROLE_ORDER = ("unet", "dit", "vae", "text")


@dataclass(frozen=True)
class Vram:
    """Peak memory of one generation, in bytes.

    ``active_peak``: torch's ``active_bytes.all.peak``; ``reserved_peak``: ``reserved_bytes.all.peak``;
    ``system_peak``: device total minus the least free memory seen (every process on the device).
    ``source`` is ``"host"`` when read from the host's own monitor, ``"own"`` from ``VramProbe``.
    ``peaks_bounded`` is True when torch's peak counters were not reset for this generation and did
    not rise during it: the active and reserved values are then upper bounds.
    """

    active_peak: int
    reserved_peak: int
    system_peak: int
    total: int
    source: str = "host"
    peaks_bounded: bool = False

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "peaks_bounded": self.peaks_bounded,
            "active_peak_bytes": self.active_peak,
            "reserved_peak_bytes": self.reserved_peak,
            "system_peak_bytes": self.system_peak,
            "total_bytes": self.total,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Vram":
        return cls(int(data["active_peak_bytes"]), int(data["reserved_peak_bytes"]), int(data["system_peak_bytes"]),
                   int(data["total_bytes"]), data.get("source", "host"), bool(data.get("peaks_bounded")))


class VramProbe:
    """VRAM of one generation: torch's peak counters and the least free device memory seen.

    By default nothing is reset: snapshots at start, ``poll`` and stop. torch's peak counters are
    cumulative; when they rise during the generation the new peak is this generation's, otherwise the old
    peak only bounds it (``Vram.peaks_bounded``). Sys is total minus the least free memory seen.

    As a webui's own memory monitor measures (A1111's ``MemUsageMonitor``): ``reset`` resets torch's peak
    counters at ``start``, so the peaks are this generation's; ``poll_hz`` samples free memory (every
    process on the device) from a thread that many times a second until ``stop``, so Sys is the
    device-wide peak over the generation. That thread also keeps the highest peak counters it saw, so a
    reset made by someone else meanwhile (the webui's monitor starting for a queued request) loses at
    most what rose in the last interval. On a non-CUDA device every method is a no-op and ``stop``
    returns None.
    """

    def __init__(self, device=None, reset: bool = False, poll_hz: float | None = None):
        self.device = device
        self.reset = reset
        self.poll_hz = poll_hz if poll_hz and poll_hz > 0 else None
        self._start: dict | None = None
        self._min_free: int | None = None
        self._peaks = {"active_peak": 0, "reserved_peak": 0}
        self._total = 0
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def _cuda(self):
        import torch

        device = torch.device(self.device) if self.device is not None else None
        if device is not None and device.type != "cuda":
            return None
        if not torch.cuda.is_available():
            return None
        return torch.cuda

    def _index(self, cuda):
        import torch

        device = torch.device(self.device) if self.device is not None else None
        return device.index if device is not None and device.index is not None else cuda.current_device()

    def _peaks_now(self, cuda) -> dict:
        stats = cuda.memory_stats(self._index(cuda))
        return {"active_peak": stats.get("active_bytes.all.peak", 0),
                "reserved_peak": stats.get("reserved_bytes.all.peak", 0)}

    def start(self) -> "VramProbe":
        cuda = self._cuda()
        if cuda is None:
            return self
        if self.reset:
            cuda.reset_peak_memory_stats(self._index(cuda))
        self._start = self._peaks_now(cuda)
        self._peaks = dict(self._start)
        self._min_free = None
        self.poll()
        if self.poll_hz is not None:
            self._thread = threading.Thread(target=self._run, name="lib_attn VRAM poll", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._halt.wait(1 / self.poll_hz):
            try:
                self.poll()
            except Exception:  # the device went away: stop's own reading says what it can
                return

    def poll(self) -> None:
        """Take one free-memory sample (one driver query) and, when polling, the peak counters."""
        if self._start is None:
            return
        cuda = self._cuda()
        free, total = cuda.mem_get_info(self._index(cuda))
        peaks = self._peaks_now(cuda) if self.poll_hz is not None else None
        with self._lock:
            self._total = total
            self._min_free = free if self._min_free is None else min(self._min_free, free)
            if peaks is not None:
                self._peaks = {k: max(v, peaks[k]) for k, v in self._peaks.items()}

    def read(self) -> Vram | None:
        """The figures from ``start`` to now, the probe going on (for a report made while the work goes on)."""
        start = self._start
        if start is None:
            return None
        self.poll()
        last = self._peaks_now(self._cuda())
        with self._lock:
            active = max(last["active_peak"], self._peaks["active_peak"])
            reserved = max(last["reserved_peak"], self._peaks["reserved_peak"])
            total, min_free = self._total, self._min_free
        rose = active > start["active_peak"] or reserved > start["reserved_peak"]
        return Vram(active, reserved, total - min_free, total, "own", not (self.reset or rose))

    def stop(self) -> Vram | None:
        if self._start is None:
            return None
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        vram = self.read()
        self._start = None
        return vram


def role_rank(role: str) -> int:
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


@dataclass(frozen=True)
class Report:
    """What one generation's attention did.

    ``calls``: {(role, backend id): n}; ``fallbacks``: {(role, backend id passed over, reason): n};
    ``kernels``: {backend id: description with version, e.g. "flash-attn 2.8.3 (FA3)"};
    ``seconds``: wall time of the generation, or None; ``vram``: a ``Vram`` or None (CPU, unmeasured).
    ``notes``: what the user should know about this generation (an override or setting that was ignored,
    and why); ``ran_on``: what ran attention when it did not go through the engine (e.g. "A1111's
    InvokeAI optimizer"); ``hint``: how to route attention through the engine then;
    ``tuned``: the (role, backend id) pairs that tuning chose rather than the fixed order;
    ``paths``: {fallback key: {(((id, reason), ...) also passed over, id that ran)}};
    ``guard``: {(role, backend id, what, backend that ran instead, recomputed): n}, what the output
    guard caught; ``rules``: {(schedule text, rule label, role,
    backend id): n}, the calls a schedule served, per rule (``rule_items`` in the schedule's order);
    ``parallel``: {(role, kind, mode, ranks, ulysses, ring, note): (calls, bytes this rank sent)}, the
    calls split over several ranks (``lib_attn.parallel``); ``sparse``: what sparse attention did
    (``lib_attn.sparse_report.SparseReport``), or None when it served no call; ``recomputed``:
    {(role, backend id): n}, the calls of ``calls`` that ran inside a backward pass (recomputed by
    activation checkpointing), the rest being forward calls.
    """

    calls: dict = field(default_factory=dict)
    fallbacks: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    seconds: float | None = None
    vram: Vram | None = None
    notes: tuple = ()
    ran_on: str | None = None
    hint: str | None = None
    tuned: frozenset = frozenset()
    paths: dict = field(default_factory=dict, compare=False)  # in-process detail: not in the JSON
    guard: dict = field(default_factory=dict)
    rules: dict = field(default_factory=dict)
    parallel: dict = field(default_factory=dict)
    sparse: SparseReport | None = None
    recomputed: dict = field(default_factory=dict)

    @classmethod
    def from_recording(cls, rec, seconds: float | None = None, vram: Vram | None = None) -> "Report":
        """From a ``lib_attn.Recording``; ``seconds`` defaults to the recording's own wall time."""
        if seconds is None:
            seconds = getattr(rec, "seconds", None)
        return cls(dict(rec.calls), dict(rec.fallbacks), dict(rec.kernels), seconds, vram,
                   tuned=frozenset(getattr(rec, "tuned", ())), paths=dict(getattr(rec, "paths", {})),
                   guard=dict(getattr(rec, "guard", {})), rules=dict(getattr(rec, "rules", {})),
                   parallel=dict(getattr(rec, "parallel", {})), sparse=getattr(rec, "sparse", None),
                   recomputed=dict(getattr(rec, "recomputed", {})))

    def roles(self) -> list[str]:
        present = {role for role, _ in self.calls}
        return sorted(present, key=lambda r: (role_rank(r), r))

    def backends(self, role: str) -> list[tuple[str, int]]:
        """(backend id, calls) of one role, most calls first (ties keep the order they were met)."""
        items = [(b, n) for (r, b), n in self.calls.items() if r == role]
        return sorted(items, key=lambda item: -item[1])

    def main_backend(self) -> str | None:
        """The backend id that took most denoiser (UNet or DiT) calls, or None when none ran."""
        for role in ("unet", "dit"):
            ranked = self.backends(role)
            if ranked:
                return ranked[0][0]
        return None

    def total(self, role: str | None = None) -> int:
        return sum(n for (r, _), n in self.calls.items() if role is None or r == role)

    def describe(self, backend: str) -> str:
        """The backend id with its version; always starts with the id so that it can be parsed back."""
        desc = self.kernels.get(backend) or backend
        return desc if desc.split(" ")[0] == backend else f"{backend} ({desc})"

    def is_tuned(self, role: str, backend: str) -> bool:
        return (role, backend) in self.tuned

    def fallback_items(self) -> list:
        """((role, backend, reason), n) pairs: by role, then most frequent first."""
        items = list(self.fallbacks.items())
        return sorted(items, key=lambda item: (role_rank(item[0][0]), -item[1], item[0][1], item[0][2]))

    def path(self, fallback_key: tuple) -> tuple[list, list]:
        """(the other backends passed over as (id, reason), in chain order; the ids that ran) for one
        fallback; both empty when not known."""
        paths = sorted(self.paths.get(fallback_key, ()))
        others = list(dict.fromkeys(pair for passed, _ in paths for pair in passed))
        return others, list(dict.fromkeys(ran for _, ran in paths))

    def guard_items(self) -> list:
        """((role, backend, what, ran_on, recomputed), n) pairs: by role, then most frequent first."""
        return sorted(self.guard.items(), key=lambda item: (role_rank(item[0][0]), -item[1], item[0][1:3]))

    def parallel_items(self) -> list:
        """((role, kind, mode, ranks, ulysses, ring, note), (calls, bytes sent)) pairs: by role, then most
        calls first."""
        return sorted(self.parallel.items(), key=lambda item: (role_rank(item[0][0]), -item[1][0], item[0][1:]))

    @property
    def schedules(self) -> list[str]:
        """The schedules (their text) that served calls, in the order they were met (one, normally)."""
        return list(dict.fromkeys(text for text, _, _, _ in self.rules))

    def rule_items(self, schedule: str) -> list[tuple[str, list]]:
        """(rule label, [(role, backend id, n), ...]) for each rule of ``schedule`` that served calls, in
        the schedule's order, the calls no rule took (``otherwise``) last; backends by role, then most
        calls first."""
        try:
            order = parse(schedule).labels
        except ValueError:
            order = []
        labels = {label for text, label, _, _ in self.rules if text == schedule}
        ranked = sorted(labels, key=lambda label: (label == OTHERWISE, order.index(label) if label in order
                                                   else len(order), label))
        out = []
        for label in ranked:
            items = [(role, b, n) for (text, lab, role, b), n in self.rules.items() if text == schedule and lab == label]
            out.append((label, sorted(items, key=lambda item: (role_rank(item[0]), -item[2]))))
        return out

    def to_dict(self) -> dict:
        """The report as JSON-ready data (``from_dict`` reads it back); ``parallel`` only when calls ran
        split over ranks, ``sparse`` only when sparse attention served calls, ``recomputed`` only when
        calls were recomputed in a backward pass."""
        data = {
            "calls": [{"role": role, "backend": b, "kernel": self.describe(b), "count": n,
                       "tuned": self.is_tuned(role, b)}
                      for role in self.roles() for b, n in self.backends(role)],
            "fallbacks": [{"role": role, "backend": b, "reason": reason, "count": n}
                          for (role, b, reason), n in self.fallback_items()],
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "vram": None if self.vram is None else self.vram.to_dict(),
            "guard": [{"role": role, "backend": b, "what": what, "ran_on": ran_on, "recomputed": bool(done),
                       "count": n} for (role, b, what, ran_on, done), n in self.guard_items()],
            "schedule": self.schedules[0] if len(self.schedules) == 1 else (self.schedules or None),
            "rules": [{"schedule": text, "rule": label, "role": role, "backend": b, "count": n}
                      for text in self.schedules for label, items in self.rule_items(text) for role, b, n in items],
            "notes": list(self.notes),
            "ran_on": self.ran_on,
            "hint": self.hint,
        }
        if self.parallel:
            data["parallel"] = [{"role": role, "kind": kind, "mode": mode, "ranks": ranks, "ulysses": u, "ring": r,
                                 "note": note, "count": n, "bytes_sent": sent, "bytes_per_call": sent // n if n else 0}
                                for (role, kind, mode, ranks, u, r, note), (n, sent) in self.parallel_items()]
        if self.sparse is not None:
            data["sparse"] = self.sparse.to_dict()
        if self.recomputed:
            data["recomputed"] = [{"role": role, "backend": b, "count": n}
                                  for (role, b), n in sorted(self.recomputed.items(),
                                                             key=lambda item: (role_rank(item[0][0]), -item[1]))]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """The inverse of ``to_dict`` (extra keys, such as a host's text, are ignored)."""
        calls = {(c["role"], c["backend"]): int(c["count"]) for c in data.get("calls", ())}
        kernels = {c["backend"]: c["kernel"] for c in data.get("calls", ())}
        fallbacks = {(f["role"], f["backend"], f["reason"]): int(f["count"]) for f in data.get("fallbacks", ())}
        v = data.get("vram")
        tuned = frozenset((c["role"], c["backend"]) for c in data.get("calls", ()) if c.get("tuned"))
        guard = {(g["role"], g["backend"], g["what"], g["ran_on"], bool(g["recomputed"])): int(g["count"])
                 for g in data.get("guard", ())}
        rules = {(r["schedule"], r["rule"], r["role"], r["backend"]): int(r["count"]) for r in data.get("rules", ())}
        parallel = {(p["role"], p["kind"], p["mode"], int(p["ranks"]), int(p["ulysses"]), int(p["ring"]), p["note"]):
                    (int(p["count"]), int(p["bytes_sent"])) for p in data.get("parallel", ())}
        recomputed = {(r["role"], r["backend"]): int(r["count"]) for r in data.get("recomputed", ())}
        return cls(calls, fallbacks, kernels, data.get("seconds"), Vram.from_dict(v) if v else None,
                   tuple(data.get("notes") or ()), data.get("ran_on"), data.get("hint"), tuned, guard=guard,
                   rules=rules, parallel=parallel, sparse=SparseReport.from_dict(data.get("sparse")),
                   recomputed=recomputed)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)
