"""What belongs to the thread (or asyncio task) doing a piece of work rather than to the process: the
configuration ``use`` put in force, where its sampling is (the schedule's position), and the
recordings ``recording`` opened.

A ``Scope`` holds them, kept in a context variable, so each thread has its own (a new thread starts in
none) and each asyncio task the one of the code that created it. Code that never entered a scope runs
in ``GLOBAL``: the process-wide configuration (``configure``: the hosts' settings and flags), the
process's position, and no recording. ``use`` enters a scope with its own configuration and
position; ``recording`` one that keeps its parent's and adds a recording. Leaving restores the
parent. Two threads that each enter their own ``use`` and ``recording`` run on their own kernels and
count their own calls only. (The dispatcher's decisions are keyed on the configuration's ``token``,
so scopes with equal configurations share them.)
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar


class Scope:
    """``config``: the ``Config`` in force here (None: the process-wide one, whatever it is when a call
    is made); ``where``: the schedule's position (a ``lib_attn.schedule.Where``); ``recordings``: the
    open recordings that count this scope's calls, outermost first; ``calls``: their call counters,
    which the dispatcher adds each call to."""

    __slots__ = ("config", "where", "recordings", "calls")

    def __init__(self, config, where, recordings: tuple = ()):
        self.config = config
        self.where = where
        self.recordings = recordings
        self.calls = tuple(rec.here["calls"] for rec in recordings)


#: The scope of code that entered none. Its ``config`` is the process-wide configuration and its
#: ``where`` the process's position (``lib_attn.config`` and ``lib_attn.schedule`` set them).
GLOBAL = Scope(None, None)
_current: ContextVar = ContextVar("lib_attn_scope", default=None)
#: ``get() or GLOBAL`` is the scope in force: the dispatcher reads it once per call.
get = _current.get


def current() -> Scope:
    return _current.get() or GLOBAL


@contextlib.contextmanager
def entered(scope: Scope):
    """Put ``scope`` in force for the ``with`` block, then the one before it again (also when the block
    ends in another context than it began in, where the context variable's token does not apply)."""
    before = _current.get()
    token = _current.set(scope)
    try:
        yield scope
    finally:
        try:
            _current.reset(token)
        except ValueError:
            _current.set(before)
