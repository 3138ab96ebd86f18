"""A report as the webuis show it: the readout lines under the image, the infotext entries and their
parsing, the reading of the webui's own memory monitor, and the last generation's report (the
status route's). Each part's text is ``lib_attn.readout``'s; the layout and A1111's terms are here.

The VRAM figures are the webui's own monitor's when it measures the generation, and otherwise measured
the way it measures (peak active bytes and peak reserved bytes since the generation started, the
device-wide used memory polled over it, out of the total), rounded the same way, so that the two lines
under an image compare number for number.
Infotext written by every earlier version of the extension parses with ``from_infotext``.
"""
from __future__ import annotations

import dataclasses
import json
import re
import threading

from lib_attn.report import MIB, Report, Vram, VramProbe
from lib_attn.schedule import parse
from lib_attn.sparse import parse as parse_sparse

from lib_attn.readout import (SCHEDULE_KEY, TUNED_MARK, guard_lines, kernel_text, one_line, role_mark, schedule_text,
                               sparse_lines)

_MARK_ROLE = {"VAE": "vae", "Text": "text", "DiT": "dit"}

INFOTEXT_KEY = "Attention"
INFOTEXT_FALLBACKS_KEY = "Attention fallbacks"
INFOTEXT_NOTE_KEY = "Attention note"
INFOTEXT_GUARD_KEY = "Attention guard"
#: The schedule in force (its one-line text); the readout's line of that name counts the calls per rule.
INFOTEXT_SCHEDULE_KEY = SCHEDULE_KEY
INFOTEXT_KEYS = (INFOTEXT_KEY, INFOTEXT_FALLBACKS_KEY, INFOTEXT_GUARD_KEY, INFOTEXT_SCHEDULE_KEY, INFOTEXT_NOTE_KEY)
#: The sparse settings a generation ran under (their one-line text, known when it starts), which
#: paste-back restores; not among the report's entries above.
INFOTEXT_SPARSE_KEY = "Sparse attention"
#: What the user chose for that generation in the accordion (or the API's script arguments), apart from
#: what ran: the backend and the guard. Paste-back restores these, never the backend that ran.
INFOTEXT_OVERRIDE_KEY = "Attention override"
INFOTEXT_GUARD_OVERRIDE_KEY = "Attention guard override"


def _mib_up(n: int) -> int:
    """Bytes rounded up to whole MiB, as the webui rounds its memory readout."""
    return -(int(n) // -MIB)


def vram_text(vram: Vram) -> str:
    """``A: 3.21 GB, R: 4.00 GB, Sys: 5.6/79.6475 GB (7.1%)``: the webui's numbers and rounding; a ``≤``
    marks peaks that only bound this generation's."""
    a, r = _mib_up(vram.active_peak), _mib_up(vram.reserved_peak)
    s, t = _mib_up(vram.system_peak), _mib_up(vram.total)
    bound = "≤" if vram.peaks_bounded else ""
    pct = s / max(t, 1) * 100
    return (f"A: {bound}{a / 1024:.2f} GB, R: {bound}{r / 1024:.2f} GB, "
            f"Sys: {s / 1024:.1f}/{t / 1024:g} GB ({pct:.1f}%)")


def elapsed_text(seconds: float) -> str:
    """Time as the webui writes it: ``12.3 sec.`` or ``1 min. 2.3 sec.``."""
    minutes, rest = int(seconds // 60), seconds % 60
    return f"{minutes} min. {rest:.1f} sec." if minutes else f"{rest:.1f} sec."


# --- the webui's memory monitor ------------------------------------------------------------------

def vram_from_monitor(data: dict) -> Vram:
    """From a dict with the webui monitor's keys (active_peak, reserved_peak, system_peak, total)."""
    return Vram(int(data["active_peak"]), int(data["reserved_peak"]), int(data["system_peak"]), int(data["total"]),
                "host")


def monitor_running(mem_mon) -> bool:
    """Whether the webui's memory monitor is measuring the current request."""
    if mem_mon is None or getattr(mem_mon, "disabled", True):
        return False
    run_flag = getattr(mem_mon, "run_flag", None)
    return run_flag is not None and run_flag.is_set()


#: A1111's ``memmon_poll_rate`` default: the rate the extension polls at when the webui's is 0.
DEFAULT_POLL_HZ = 8


def host_measures(p, shared) -> bool:
    """Whether the webui's own monitor measures this generation, so that its numbers are the ones to show.

    It runs for a generation started from the UI (``wrap_gradio_call_no_job`` starts it before taking the
    queue lock, with ``memmon_poll_rate`` above 0 and CUDA), never for one of the API (``p.is_api``). A UI
    request queued behind a UI generation finds it stopped by the one before it (A1111 clears the flag
    when that one ends): the monitor then does not run, and the extension measures itself."""
    return not getattr(p, "is_api", False) and monitor_running(getattr(shared, "mem_mon", None))


def own_probe(shared) -> VramProbe:
    """A probe that measures as the webui's monitor does: torch's peaks reset when the generation starts,
    free device memory polled at the webui's rate (``memmon_poll_rate``; 8 when that is 0)."""
    rate = getattr(getattr(shared, "opts", None), "memmon_poll_rate", 0) or 0
    return VramProbe(getattr(shared, "device", None), reset=True,
                     poll_hz=rate if rate > 0 else DEFAULT_POLL_HZ)


def host_vram(mem_mon) -> Vram | None:
    """The webui monitor's numbers, when it is measuring this generation; else None.

    The monitor resets torch's peak counters itself when a UI generation starts; it does not run for
    API generations or when disabled (no CUDA, poll rate 0). Reading it does not disturb it.
    """
    if not monitor_running(mem_mon):
        return None
    try:
        return vram_from_monitor(mem_mon.read())
    except KeyError:  # its thread has not taken the first sample yet
        return None


# --- the readout ----------------------------------------------------------------------------------

def calls_text(report: Report) -> str:
    parts = []
    for role in report.roles():
        ran = " + ".join(f"{kernel_text(report, role, b)} ×{n:,}" for b, n in report.backends(role))
        parts.append(role_mark(report, role) + ran)
    if parts:
        return " · ".join(parts)
    return f"{report.ran_on}, not through this extension" if report.ran_on else "no attention calls"


def fallbacks_text(report: Report) -> str:
    return "; ".join(f"{role_mark(report, role)}{backend} ×{n:,}: {one_line(reason)}"
                     for (role, backend, reason), n in report.fallback_items())


def guard_text(report: Report) -> str:
    """What the guard caught: ``sage ×3 non-finite values → sdpa (recomputed); …``."""
    return "; ".join(one_line(line.removeprefix("guard: ")) for line in guard_lines(report))


def lines(report: Report) -> list[str]:
    """The readout: ``Attention: …`` then, when a schedule served calls, ``Attention schedule: …`` (calls
    per rule), when sparse attention served calls, what it did (``lib_attn.readout.sparse_lines``), when
    anything fell back, ``Attention fallbacks: …``, when the guard caught anything, ``Attention guard: …``,
    then notes."""
    head = [calls_text(report)]
    if report.seconds is not None:
        head.append(elapsed_text(report.seconds))
    if report.vram is not None:
        head.append(vram_text(report.vram))
    out = [f"{INFOTEXT_KEY}: " + " · ".join(head)]
    if report.rules:
        out.append(f"{INFOTEXT_SCHEDULE_KEY}: {schedule_text(report)}")
    out += sparse_lines(report)
    if report.fallbacks:
        out.append(f"{INFOTEXT_FALLBACKS_KEY}: {fallbacks_text(report)}")
    if report.guard:
        out.append(f"{INFOTEXT_GUARD_KEY}: {guard_text(report)}")
    out.extend(f"{INFOTEXT_NOTE_KEY}: {note}" for note in (*report.notes, *([report.hint] if report.hint else ())))
    return out


def text(report: Report) -> str:
    return "\n".join(lines(report))


def to_json(report: Report) -> dict:
    """The report's data plus the webui's text of it (``text``, ``infotext``, ``vram.text``): what the
    status route returns."""
    data = report.to_dict()
    if data["vram"] is not None:
        data["vram"]["text"] = vram_text(report.vram)
    data["text"] = lines(report)
    data["infotext"] = to_infotext(report)
    return data


# --- infotext -------------------------------------------------------------------------------------

def to_infotext(report: Report) -> dict:
    """Infotext entries: ``Attention`` (backend ids with versions, per role) and, when any,
    ``Attention fallbacks`` (with counts and reasons), ``Attention guard``, ``Attention schedule`` (the
    schedule's text, which ``schedule_from_infotext`` reads back) and ``Attention note``. Empty when no
    call ran."""
    segments = [role_mark(report, role) + " + ".join(kernel_text(report, role, b) for b, _ in report.backends(role))
                for role in report.roles()]
    out = {}
    if segments:
        out[INFOTEXT_KEY] = "; ".join(segments)
    if report.fallbacks:
        out[INFOTEXT_FALLBACKS_KEY] = fallbacks_text(report)
    if report.guard:
        out[INFOTEXT_GUARD_KEY] = guard_text(report)
    if report.schedules:
        out[INFOTEXT_SCHEDULE_KEY] = " | ".join(report.schedules)
    if report.notes:
        out[INFOTEXT_NOTE_KEY] = "; ".join(one_line(note) for note in report.notes)
    return out


_FALLBACK_RE = re.compile(r"^(?:(?P<prefix>VAE |Text |DiT ))?(?P<backend>\S+) [×x](?P<count>[\d,]+): (?P<reason>.*)$")
#: Fallback entries are joined with "; ", which reasons may hold too: split only where an entry starts.
_ENTRY_START = re.compile(r"; (?=(?:VAE |Text |DiT )?[\w.-]+ [×x][\d,]+: )")


def _split_prefix(segment: str) -> tuple[str, str]:
    head, _, rest = segment.partition(" ")
    if head in _MARK_ROLE and rest:
        return _MARK_ROLE[head], rest
    return "unet", segment


def from_infotext(params) -> Report | None:
    """The report an infotext describes (backends per role, fallbacks; call counts of the ``Attention``
    entry are not recorded and read back as 0). ``params`` is the dict the webui parsed from an
    infotext, or the infotext's text itself. None when it has no ``Attention``."""
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
    for entry in (part for part in _ENTRY_START.split(str(params.get(INFOTEXT_FALLBACKS_KEY) or "")) if part):
        match = _FALLBACK_RE.match(entry)
        if match is None:
            continue
        role = _MARK_ROLE.get((match["prefix"] or "").strip(), "unet")
        fallbacks[(role, match["backend"], match["reason"])] = int(match["count"].replace(",", ""))
    return Report(calls, fallbacks, kernels, tuned=frozenset(tuned))


def schedule_from_infotext(params) -> str | None:
    """The schedule a pasted infotext recorded (its text, as the schedule fields take it), or None when
    it recorded none or one this version cannot read (the paste then leaves the field as it was)."""
    if isinstance(params, str):
        params = parse_infotext(params)
    value = str((params or {}).get(INFOTEXT_SCHEDULE_KEY) or "").split(" | ")[0].strip()
    if not value:
        return None
    try:
        return parse(value).text
    except ValueError:
        return None


def sparse_from_infotext(params) -> str | None:
    """The sparse settings a pasted infotext recorded (their text, as the sparse fields take it), or None
    when it recorded none or settings this version cannot read (the paste then leaves the field as it was)."""
    if isinstance(params, str):
        params = parse_infotext(params)
    value = str((params or {}).get(INFOTEXT_SPARSE_KEY) or "").strip()
    if not value:
        return None
    try:
        settings = parse_sparse(value)
    except ValueError:
        return None
    return settings.text if settings is not None else None


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


def with_notes(report: Report, notes: tuple, ran_on: str | None, hint: str | None) -> Report:
    return dataclasses.replace(report, notes=notes, ran_on=ran_on, hint=hint)


# --- the last generation --------------------------------------------------------------------------

_lock = threading.Lock()
_last: Report | None = None


def last_report() -> Report | None:
    """The report of the last finished generation (the status route's ``last_report``), or None."""
    return _last


def set_last_report(report: Report | None) -> None:
    global _last
    with _lock:
        _last = report
