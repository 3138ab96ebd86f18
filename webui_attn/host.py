"""Which webui is running: A1111, Forge, or neither.

Detection imports nothing that only one host has at top level: Forge is recognised by its
``backend.attention`` module, A1111 by ``SdOptimization`` (which Forge commented out).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass

A1111 = "a1111"
FORGE = "forge"
NONE = "none"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        # find_spec imports the parents; a missing or broken parent package means "not this host"
        return False


def detect() -> str:
    """``"a1111"``, ``"forge"`` or ``"none"`` for the process this runs in."""
    if not _importable("modules"):
        return NONE
    if _importable("backend.attention") and _importable("backend.nn"):
        return FORGE
    try:
        module = importlib.import_module("modules.sd_hijack_optimizations")
    except ImportError:
        return NONE
    return A1111 if hasattr(module, "SdOptimization") else NONE


PREFIX = "[flash-attention]"
_said: set = set()


def log(message: str) -> None:
    """One line on stdout, where both webuis' users look for startup messages."""
    print(f"{PREFIX} {message}")


def log_once(key, message: str) -> None:
    """Like ``log`` but at most once per process for ``key`` (survives "Reload UI")."""
    if key in _said:
        return
    _said.add(key)
    log(message)


class _ToLog(logging.Handler):
    def emit(self, record):
        log(record.getMessage())


def prefix_engine_log() -> None:
    """Print the engine's warnings (fallbacks met for the first time) through ``log``, with this
    extension's prefix, instead of in whatever format the webui gives the root logger; once per process."""
    logger = logging.getLogger("lib_attn")
    if any(isinstance(h, _ToLog) for h in logger.handlers):
        return
    logger.addHandler(_ToLog(logging.WARNING))
    logger.propagate = False


def unprefix_engine_log() -> None:
    """Undo ``prefix_engine_log`` (script unload)."""
    logger = logging.getLogger("lib_attn")
    for handler in [h for h in logger.handlers if isinstance(h, _ToLog)]:
        logger.removeHandler(handler)
    logger.propagate = True


@dataclass(frozen=True)
class Routing:
    """Whether attention goes through this extension now, and if not, what runs it instead.

    ``ran_on``: what runs attention when not routed, e.g. "A1111's InvokeAI optimizer"; ``hint``: how
    to route attention through the extension (shown in the readout, not in the infotext).
    """

    routed: bool
    ran_on: str | None = None
    hint: str | None = None


ROUTED = Routing(True)
