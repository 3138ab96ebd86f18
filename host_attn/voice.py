"""The extension's voice in the host's console, and what "routed" means for a host.

Every message starts with ``[flash-attention]`` and goes to stdout, where the hosts' users look for
startup messages; the engine's own warnings are printed the same way.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

PREFIX = "[flash-attention]"
_said: set = set()


def log(message: str) -> None:
    """One line on stdout, where the hosts' users look for startup messages; flushed at once, since
    ComfyUI holds a print to a stdout that is not a terminal in its own buffer."""
    print(f"{PREFIX} {message}", flush=True)


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
    extension's prefix, instead of in whatever format the host gives the root logger; once per process."""
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
