"""What sparse attention did in a stretch of work, as data: ``SparseReport``, built from a recording's
sparse tables (``lib_attn.stats``), and its JSON, which the hosts show and store.

Errors are the relative L2 error of a call's output on the sampled rows against exact attention, as
measured (``lib_attn.sparse_measure.output_error``), over the sparse outputs that were returned; a
measured output over the budget is recomputed, and counted apart (``replaced``) with its error.
``kept`` is the share of (query block, key block) pairs the measured calls computed. Seconds are measured on the CPU, where a call's time can
be read without waiting for a device; elsewhere they are absent.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def _kind_order(item):
    (role, backend, kind, setting), calls = item
    return (role, -calls, kind, setting)


@dataclass(frozen=True)
class SparseReport:
    """``settings``: the sparse settings' text (``Sparse.text``) that served most calls; ``budget``;
    ``kinds``: {(role, backend, kind, setting): sparse calls}; ``dense``: {(role, reason): dense calls
    while sparse was on}; ``errors``: {(role, backend, kind, setting, error): measurements};
    ``kept``: {(role, backend, kind, setting): sum of the share of blocks kept over its measurements};
    ``seconds``: {"sparse" | "dense" | "calibration": attention seconds} (CPU only; ``calibration``: the
    calls that calibrated a kind, a kernel's compile for a new shape included); ``replaced``: {(role,
    backend, kind, setting, error): measured outputs over the budget, recomputed rather than returned}."""

    settings: str | None = None
    budget: float | None = None
    kinds: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    replaced: dict = field(default_factory=dict)

    @classmethod
    def from_tables(cls, tables: dict) -> "SparseReport | None":
        """From a recording's counters by table name; None when sparse attention served no call."""
        served = tables.get("sparse_settings") or {}
        if not served:
            return None
        (text, budget), _ = max(served.items(), key=lambda item: item[1])
        return cls(text, budget, dict(tables.get("sparse") or {}), dict(tables.get("sparse_dense") or {}),
                   dict(tables.get("sparse_error") or {}), dict(tables.get("sparse_kept") or {}),
                   {part: seconds for (part,), seconds in (tables.get("sparse_seconds") or {}).items()},
                   dict(tables.get("sparse_replaced") or {}))

    # -- summaries -------------------------------------------------------------------------------

    @property
    def calls(self) -> int:
        return sum(self.kinds.values())

    @property
    def dense_calls(self) -> int:
        return sum(self.dense.values())

    def _measured(self, where=None) -> list:
        out = []
        for (role, backend, kind, setting, error), n in self.errors.items():
            if where is None or (role, backend, kind, setting) == where:
                out.extend([error] * n)
        return out

    @property
    def measured(self) -> int:
        return len(self._measured())

    def error_max(self, where=None) -> float | None:
        found = [e for e in self._measured(where) if not math.isnan(e)]
        return max(found) if found else None

    def error_typical(self, where=None) -> float | None:
        """The median measured error."""
        found = [e for e in self._measured(where) if not math.isnan(e)]
        return statistics.median(found) if found else None

    def kept_share(self, where=None) -> float | None:
        """The mean share of blocks kept over the measured calls."""
        keys = [key for key in self.kept if where is None or key == where]
        n = sum(len(self._measured(key)) for key in keys)
        return sum(self.kept[key] for key in keys) / n if n else None

    @property
    def replaced_calls(self) -> int:
        """Measured outputs over the budget that were recomputed, not returned."""
        return sum(self.replaced.values())

    def replaced_error_max(self) -> float | None:
        found = [e for (_, _, _, _, e), n in self.replaced.items() if n and not math.isnan(e)]
        return max(found) if found else None

    def kind_items(self) -> list:
        return sorted(self.kinds.items(), key=_kind_order)

    def dense_items(self) -> list:
        return sorted(self.dense.items(), key=lambda item: (item[0][0], -item[1], item[0][1]))

    # -- JSON ------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        def rounded(x):
            return None if x is None else round(x, 4)

        return {
            "settings": self.settings,
            "budget": self.budget,
            "calls": self.calls,
            "kept": rounded(self.kept_share()),
            "error_max": rounded(self.error_max()),
            "error_typical": rounded(self.error_typical()),
            "measured": self.measured,
            "replaced": self.replaced_calls,
            "replaced_error_max": rounded(self.replaced_error_max()),
            "kinds": [{"role": role, "backend": backend, "kind": kind, "setting": setting, "calls": n,
                       "kept": rounded(self.kept_share(key)), "error_max": rounded(self.error_max(key)),
                       "error_typical": rounded(self.error_typical(key)), "measured": len(self._measured(key))}
                      for key, n in self.kind_items() for role, backend, kind, setting in [key]],
            "dense": [{"role": role, "reason": reason, "count": n} for (role, reason), n in self.dense_items()],
            "measurements": [{"role": role, "backend": backend, "kind": kind, "setting": setting, "error": error,
                              "count": n}
                             for (role, backend, kind, setting, error), n in sorted(self.errors.items(), key=str)],
            "replacements": [{"role": role, "backend": backend, "kind": kind, "setting": setting, "error": error,
                              "count": n}
                             for (role, backend, kind, setting, error), n in sorted(self.replaced.items(), key=str)],
            "kept_sums": [{"role": role, "backend": backend, "kind": kind, "setting": setting, "sum": total}
                          for (role, backend, kind, setting), total in sorted(self.kept.items(), key=str)],
            "seconds": {part: round(s, 3) for part, s in sorted(self.seconds.items())} or None,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> "SparseReport | None":
        """The inverse of ``to_dict``."""
        if not data:
            return None
        kinds = {(k["role"], k["backend"], k["kind"], k["setting"]): int(k["calls"]) for k in data.get("kinds", ())}
        dense = {(d["role"], d["reason"]): int(d["count"]) for d in data.get("dense", ())}
        errors = {(m["role"], m["backend"], m["kind"], m["setting"], float(m["error"])): int(m["count"])
                  for m in data.get("measurements", ())}
        kept = {(m["role"], m["backend"], m["kind"], m["setting"]): float(m["sum"]) for m in data.get("kept_sums", ())}
        replaced = {(m["role"], m["backend"], m["kind"], m["setting"], float(m["error"])): int(m["count"])
                    for m in data.get("replacements", ())}
        return cls(data.get("settings"), data.get("budget"), kinds, dense, errors, kept,
                   dict(data.get("seconds") or {}), replaced)
