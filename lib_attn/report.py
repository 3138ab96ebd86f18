"""The per-generation report: which kernels ran, how often, what fell back and why, time and VRAM.

Built from a ``Recording`` plus a VRAM reading. The VRAM numbers follow the webui's own readout
(peak active bytes, peak reserved bytes, device-wide used/total), rounded the same way, so the two
lines under an image can be compared number for number. Nothing here imports a webui module, and
CUDA is touched only by ``VramProbe`` on a CUDA device.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

MIB = 1024 * 1024

#: Text prefix of each role in the readout and the infotext; the denoiser (UNet or DiT) has none.
ROLE_PREFIX = {"unet": "", "dit": "", "vae": "VAE", "text": "Text"}
_PREFIX_ROLE = {"VAE": "vae", "Text": "text", "DiT": "dit"}
_ROLE_ORDER = ("unet", "dit", "vae", "text")

INFOTEXT_KEY = "Attention"
INFOTEXT_FALLBACKS_KEY = "Attention fallbacks"
INFOTEXT_NOTE_KEY = "Attention note"
#: After a backend's description where tuning chose it (measured on this machine, or stored).
TUNED_MARK = " [tuned]"


def _mib_up(n: int) -> int:
    """Bytes rounded up to whole MiB, as the webui rounds its memory readout."""
    return -(int(n) // -MIB)


@dataclass(frozen=True)
class Vram:
    """Peak memory of one generation, in bytes.

    ``active_peak``: torch's ``active_bytes.all.peak``; ``reserved_peak``: ``reserved_bytes.all.peak``;
    ``system_peak``: device total minus the least free memory seen (every process on the device).
    ``source`` is ``"host"`` when read from the webui's monitor, ``"own"`` from ``VramProbe``.
    ``peaks_bounded`` is True when torch's peak counters were not reset for this generation and did
    not rise during it: the A and R values are then upper bounds, shown with a ``≤``.
    """

    active_peak: int
    reserved_peak: int
    system_peak: int
    total: int
    source: str = "host"
    peaks_bounded: bool = False

    @classmethod
    def from_monitor(cls, data: dict, source: str = "host") -> "Vram":
        """From a dict with the webui monitor's keys (active_peak, reserved_peak, system_peak, total)."""
        return cls(int(data["active_peak"]), int(data["reserved_peak"]), int(data["system_peak"]),
                   int(data["total"]), source)

    def text(self) -> str:
        """``A: 3.21 GB, R: 4.00 GB, Sys: 5.6/79.6475 GB (7.1%)``, the webui's numbers and rounding."""
        a, r = _mib_up(self.active_peak), _mib_up(self.reserved_peak)
        s, t = _mib_up(self.system_peak), _mib_up(self.total)
        bound = "≤" if self.peaks_bounded else ""
        pct = s / max(t, 1) * 100
        return (f"A: {bound}{a / 1024:.2f} GB, R: {bound}{r / 1024:.2f} GB, "
                f"Sys: {s / 1024:.1f}/{t / 1024:g} GB ({pct:.1f}%)")

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "peaks_bounded": self.peaks_bounded,
            "active_peak_bytes": self.active_peak,
            "reserved_peak_bytes": self.reserved_peak,
            "system_peak_bytes": self.system_peak,
            "total_bytes": self.total,
            "text": self.text(),
        }


def monitor_running(mem_mon) -> bool:
    """Whether the webui's memory monitor is measuring the current request."""
    if mem_mon is None or getattr(mem_mon, "disabled", True):
        return False
    run_flag = getattr(mem_mon, "run_flag", None)
    return run_flag is not None and run_flag.is_set()


def host_vram(mem_mon) -> Vram | None:
    """The webui monitor's numbers, when it is measuring this generation; else None.

    The monitor resets torch's peak counters itself when a UI generation starts; it does not run for
    API generations or when disabled (no CUDA, poll rate 0). Reading it does not disturb it.
    """
    if not monitor_running(mem_mon):
        return None
    data = mem_mon.read()
    try:
        return Vram.from_monitor(data)
    except KeyError:  # its thread has not taken the first sample yet
        return None


class VramProbe:
    """VRAM of one generation measured without resetting anything: snapshots at start, ``poll`` and stop.

    torch's peak counters are cumulative; when they rise during the generation the new peak is this
    generation's, otherwise the old peak only bounds it (``Vram.peaks_bounded``). Sys is total minus
    the least free memory seen at the snapshots. On a non-CUDA device every method is a no-op and
    ``stop`` returns None.
    """

    def __init__(self, device=None):
        self.device = device
        self._start: dict | None = None
        self._min_free: int | None = None
        self._total = 0

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

    def start(self) -> "VramProbe":
        cuda = self._cuda()
        if cuda is None:
            return self
        index = self._index(cuda)
        stats = cuda.memory_stats(index)
        self._start = {"active_peak": stats.get("active_bytes.all.peak", 0),
                       "reserved_peak": stats.get("reserved_bytes.all.peak", 0)}
        self._min_free = None
        self.poll()
        return self

    def poll(self) -> None:
        """Take one free-memory sample (cheap: one driver query)."""
        if self._start is None:
            return
        cuda = self._cuda()
        free, total = cuda.mem_get_info(self._index(cuda))
        self._total = total
        self._min_free = free if self._min_free is None else min(self._min_free, free)

    def stop(self) -> Vram | None:
        if self._start is None:
            return None
        self.poll()
        cuda = self._cuda()
        stats = cuda.memory_stats(self._index(cuda))
        active = stats.get("active_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        rose = active > self._start["active_peak"] or reserved > self._start["reserved_peak"]
        return Vram(active, reserved, self._total - self._min_free, self._total, "own", not rose)


@dataclass(frozen=True)
class Report:
    """What one generation's attention did.

    ``calls``: {(role, backend id): n}; ``fallbacks``: {(role, backend id passed over, reason): n};
    ``kernels``: {backend id: description with version, e.g. "flash-attn 2.8.3 (FA3)"};
    ``seconds``: wall time of the generation, or None; ``vram``: a ``Vram`` or None (CPU, unmeasured).
    ``notes``: what the user should know about this generation (an override or setting that was ignored,
    and why); ``ran_on``: what ran attention when it did not go through the engine (e.g. "A1111's
    InvokeAI optimizer"); ``hint``: how to route attention through the engine then (readout only);
    ``tuned``: the (role, backend id) pairs that tuning chose rather than the fixed order.
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

    @classmethod
    def from_recording(cls, rec, seconds: float | None = None, vram: Vram | None = None) -> "Report":
        """From a ``lib_attn.Recording``; ``seconds`` defaults to the recording's own wall time."""
        if seconds is None:
            seconds = getattr(rec, "seconds", None)
        return cls(dict(rec.calls), dict(rec.fallbacks), dict(rec.kernels), seconds, vram,
                   tuned=frozenset(getattr(rec, "tuned", ())))

    # -- ordering ---------------------------------------------------------------------------
    def roles(self) -> list[str]:
        present = {role for role, _ in self.calls}
        return sorted(present, key=lambda r: (_ROLE_ORDER.index(r) if r in _ROLE_ORDER else 99, r))

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

    def _prefix(self, role: str) -> str:
        prefix = ROLE_PREFIX.get(role, role)
        if role == "dit" and any(r == "unet" for r, _ in self.calls):
            prefix = "DiT"  # both denoisers ran: keep them apart
        return prefix + " " if prefix else ""

    def describe(self, backend: str) -> str:
        """The backend id with its version; always starts with the id so that it can be parsed back."""
        desc = self.kernels.get(backend) or backend
        return desc if desc.split(" ")[0] == backend else f"{backend} ({desc})"

    def _ran(self, role: str, backend: str) -> str:
        return self.describe(backend) + (TUNED_MARK if (role, backend) in self.tuned else "")

    def fallback_items(self) -> list:
        items = list(self.fallbacks.items())
        return sorted(items, key=lambda item: (_role_rank(item[0][0]), -item[1], item[0][1], item[0][2]))

    # -- text -------------------------------------------------------------------------------
    def calls_text(self) -> str:
        parts = []
        for role in self.roles():
            ran = " + ".join(f"{self._ran(role, b)} ×{n:,}" for b, n in self.backends(role))
            parts.append(self._prefix(role) + ran)
        if parts:
            return " · ".join(parts)
        return f"{self.ran_on}, not through this extension" if self.ran_on else "no attention calls"

    def fallbacks_text(self) -> str:
        return "; ".join(f"{self._prefix(role)}{backend} ×{n:,}: {_clean(reason)}"
                         for (role, backend, reason), n in self.fallback_items())

    def lines(self) -> list[str]:
        """The readout: ``Attention: …`` then, when anything fell back, ``Attention fallbacks: …``."""
        head = [self.calls_text()]
        if self.seconds is not None:
            head.append(elapsed_text(self.seconds))
        if self.vram is not None:
            head.append(self.vram.text())
        out = [f"{INFOTEXT_KEY}: " + " · ".join(head)]
        if self.fallbacks:
            out.append(f"{INFOTEXT_FALLBACKS_KEY}: {self.fallbacks_text()}")
        out.extend(f"{INFOTEXT_NOTE_KEY}: {note}" for note in (*self.notes, *([self.hint] if self.hint else ())))
        return out

    def text(self) -> str:
        return "\n".join(self.lines())

    # -- infotext ---------------------------------------------------------------------------
    def to_infotext(self) -> dict:
        """Infotext entries: ``Attention`` (backend ids with versions, per role) and, when any,
        ``Attention fallbacks`` (with counts and reasons). Empty when no attention call ran."""
        segments = []
        for role in self.roles():
            segments.append(self._prefix(role) + " + ".join(self._ran(role, b) for b, _ in self.backends(role)))
        out = {}
        if segments:
            out[INFOTEXT_KEY] = "; ".join(segments)
        if self.fallbacks:
            out[INFOTEXT_FALLBACKS_KEY] = self.fallbacks_text()
        if self.notes:
            out[INFOTEXT_NOTE_KEY] = "; ".join(_clean(note) for note in self.notes)
        return out

    @classmethod
    def from_infotext(cls, params) -> "Report | None":
        """The report an infotext describes (backends per role, fallbacks; call counts of the
        ``Attention`` entry are not recorded and read back as 0). ``params`` is the dict the webui
        parsed from an infotext, or the infotext's text itself. None when it has no ``Attention``."""
        if isinstance(params, str):
            params = parse_infotext(params)
        value = params.get(INFOTEXT_KEY)
        if not value:
            return None
        calls, kernels, tuned = {}, {}, set()
        for segment in str(value).split("; "):
            role, rest = _split_prefix(segment.strip())
            for desc in rest.split(" + "):
                desc = desc.strip()
                backend = desc.split(" ")[0]
                calls[(role, backend)] = 0
                if desc.endswith(TUNED_MARK):
                    desc = desc[:-len(TUNED_MARK)]
                    tuned.add((role, backend))
                kernels[backend] = desc
        fallbacks = {}
        for entry in _split_fallbacks(params.get(INFOTEXT_FALLBACKS_KEY) or ""):
            match = _FALLBACK_RE.match(entry)
            if match is None:
                continue
            role = _PREFIX_ROLE.get((match["prefix"] or "").strip(), "unet")
            fallbacks[(role, match["backend"], match["reason"])] = int(match["count"].replace(",", ""))
        return cls(calls, fallbacks, kernels, tuned=frozenset(tuned))

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "calls": [{"role": role, "backend": b, "kernel": self.describe(b), "count": n,
                       "tuned": (role, b) in self.tuned}
                      for role in self.roles() for b, n in self.backends(role)],
            "fallbacks": [{"role": role, "backend": b, "reason": reason, "count": n}
                          for (role, b, reason), n in self.fallback_items()],
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "vram": None if self.vram is None else self.vram.to_dict(),
            "text": self.lines(),
            "infotext": self.to_infotext(),
            "notes": list(self.notes),
            "ran_on": self.ran_on,
            "hint": self.hint,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """The inverse of ``to_dict`` (e.g. a report read back from the webui's JSON route)."""
        calls = {(c["role"], c["backend"]): int(c["count"]) for c in data.get("calls", ())}
        kernels = {c["backend"]: c["kernel"] for c in data.get("calls", ())}
        fallbacks = {(f["role"], f["backend"], f["reason"]): int(f["count"]) for f in data.get("fallbacks", ())}
        v = data.get("vram")
        vram = None if not v else Vram(v["active_peak_bytes"], v["reserved_peak_bytes"], v["system_peak_bytes"],
                                       v["total_bytes"], v.get("source", "host"), bool(v.get("peaks_bounded")))
        tuned = frozenset((c["role"], c["backend"]) for c in data.get("calls", ()) if c.get("tuned"))
        return cls(calls, fallbacks, kernels, data.get("seconds"), vram, tuple(data.get("notes") or ()),
                   data.get("ran_on"), data.get("hint"), tuned)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


_FALLBACK_RE = re.compile(r"^(?:(?P<prefix>VAE |Text |DiT ))?(?P<backend>\S+) [×x](?P<count>[\d,]+): (?P<reason>.*)$")


def _role_rank(role: str) -> int:
    return _ROLE_ORDER.index(role) if role in _ROLE_ORDER else len(_ROLE_ORDER)


def _split_prefix(segment: str) -> tuple[str, str]:
    head, _, rest = segment.partition(" ")
    if head in _PREFIX_ROLE and rest:
        return _PREFIX_ROLE[head], rest
    return "unet", segment


#: Fallback entries are joined with "; ", which reasons may hold too: split only where an entry starts.
_ENTRY_START = re.compile(r"; (?=(?:VAE |Text |DiT )?[\w.-]+ [×x][\d,]+: )")


def _split_fallbacks(value: str) -> list[str]:
    return [part for part in _ENTRY_START.split(str(value)) if part]


def _clean(reason: str) -> str:
    """A reason on one line, so that the infotext entry parses back."""
    return " ".join(str(reason).split())


def elapsed_text(seconds: float) -> str:
    """Time as the webui writes it: ``12.3 sec.`` or ``1 min. 2.3 sec.``."""
    minutes, rest = int(seconds // 60), seconds % 60
    return f"{minutes} min. {rest:.1f} sec." if minutes else f"{rest:.1f} sec."


_INFOTEXT_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def parse_infotext(text: str) -> dict:
    """The ``Key: value`` entries of an infotext's last line (values that hold ``,`` ``:`` or a
    newline are JSON-quoted there, as the webui writes them)."""
    last = text.strip().splitlines()[-1] if text.strip() else ""
    out = {}
    for key, value in _INFOTEXT_PARAM.findall(last):
        value = value.strip()
        if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
            try:
                value = json.loads(value)
            except ValueError:
                pass
        out[key.strip()] = value
    return out


def quote_infotext(value: str) -> str:
    """A value as the webui writes it into an infotext: JSON-quoted when it holds ``,`` ``:`` or a newline."""
    value = str(value)
    if "," not in value and ":" not in value and "\n" not in value:
        return value
    return json.dumps(value, ensure_ascii=False)
