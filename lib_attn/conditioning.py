"""Where a joint call's conditioning tokens sit: the text tokens of an attention call over text and image
tokens together (MMDiT: SD3, Flux and their relatives, HunyuanVideo), which every image query attends to
and which no block-sparse routing may drop.

A host that knows them says so for the calls it makes (``text``, or ``hooks`` on the model's joint blocks,
which read each block's own arguments as it starts): ``tokens`` of them at the ``first`` or ``last`` end of
a joint sequence of ``total`` tokens. A call is told them only when its sequence is ``total`` tokens long
(``current``): another call made meanwhile (SD3.5's image-only second attention, a probe on part of the
call, a text encoder's) is not a joint call of that block, and is told nothing. Sparse backends read it:
Sol-Attn as its sink key blocks and sink query blocks, ``block-sparse`` as key blocks every query block
keeps and query blocks computed exactly.

The declaration belongs to the thread (or asyncio task) that made it, as the engine's scope does.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

FIRST, LAST = "first", "last"
SIDES = (FIRST, LAST)


@dataclass(frozen=True)
class Text:
    """``tokens`` conditioning tokens at the ``side`` (first or last) of a joint sequence of ``total``."""

    tokens: int
    total: int
    side: str = FIRST

    def __post_init__(self):
        for name in ("tokens", "total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"conditioning {name} {value!r} is not a whole number of tokens >= 0")
        if self.tokens > self.total:
            raise ValueError(f"conditioning tokens {self.tokens} exceed the joint sequence's {self.total}")
        if self.side not in SIDES:
            raise ValueError(f"conditioning side {self.side!r} is not one of {', '.join(SIDES)}")

    @property
    def span(self) -> tuple[int, int]:
        """The tokens ``[start, stop)`` of the conditioning in the joint sequence."""
        return (0, self.tokens) if self.side == FIRST else (self.total - self.tokens, self.total)

    def blocks(self, block: int) -> tuple[int, int]:
        """The blocks of ``block`` tokens ``[first, end)`` that hold a conditioning token."""
        start, stop = self.span
        return start // block, -(-stop // block)

    @property
    def text(self) -> str:
        return f"{self.tokens} text tokens {self.side}"


#: (Text, the value before it, the hook that set it or None) of the thread's current declaration.
_current: ContextVar = ContextVar("lib_attn_conditioning", default=None)


def current(seq_len: int) -> Text | None:
    """The conditioning of a call over ``seq_len`` tokens: the one declared here when its joint sequence is
    that long and holds any, else None."""
    found = _current.get()
    if found is None or found[0].total != seq_len or not found[0].tokens:
        return None
    return found[0]


def current_blocks(seq_len: int, block: int) -> tuple[int, int] | None:
    """The blocks of ``block`` tokens ``[first, end)`` that hold the conditioning of a call over ``seq_len``
    tokens (``current``), or None."""
    told = current(seq_len)
    return None if told is None else told.blocks(block)


@contextlib.contextmanager
def text(tokens: int, total: int, side: str = FIRST):
    """Calls inside this block over ``total`` tokens are joint calls with ``tokens`` conditioning tokens at
    their ``side`` (``first`` or ``last``). A bad value raises ValueError naming it."""
    declared = Text(tokens, total, side)
    mark = _current.set((declared, _current.get(), None))
    try:
        yield declared
    finally:
        _current.reset(mark)


# --- told by a model's blocks ----------------------------------------------------------------------

def joint_reader(image: tuple[str, int], text_at: tuple[str, int], side: str):
    """A reader of a joint block's call: its image and text hidden states are the argument named
    ``image[0]`` (or the positional ``image[1]``) and ``text_at[0]`` (``text_at[1]``), (batch, tokens,
    ...) each; its attention runs over them joined with the text at ``side``."""
    def read(args, kwargs) -> Text | None:
        found = [kwargs.get(name, args[at] if len(args) > at else None) for name, at in (image, text_at)]
        if any(getattr(t, "dim", lambda: 0)() < 2 for t in found):
            return None
        img, txt = (int(t.shape[1]) for t in found)
        return Text(txt, img + txt, side)
    return read


def readers(model, lists, reader_of) -> list:
    """(block, reader) for each block in ``model``'s block lists named ``lists`` for which ``reader_of(block)``
    gives a reader (else the block is passed over)."""
    found = []
    for name in lists:
        for block in getattr(model, name, None) or ():
            read = reader_of(block)
            if read is not None:
                found.append((block, read))
    return found


@contextlib.contextmanager
def hooks(blocks):
    """While the ``with`` block runs, each ``(module, read)`` of ``blocks`` declares the conditioning of its
    calls: ``read(args, kwargs)`` gives a ``Text`` or None (nothing known: nothing declared) as the module
    starts, and the declaration ends with the module's call, also when it raises."""
    handles = []
    try:
        for module, read in blocks:
            mark = object()

            def starts(module, args, kwargs, read=read, mark=mark):
                declared = read(args, kwargs)
                if declared is not None:
                    _current.set((declared, _current.get(), mark))

            def ends(module, args, kwargs, output, mark=mark):
                found = _current.get()
                if found is not None and found[2] is mark:
                    _current.set(found[1])

            handles.append(module.register_forward_pre_hook(starts, with_kwargs=True))
            handles.append(module.register_forward_hook(ends, with_kwargs=True, always_call=True))
        yield len(handles) // 2
    finally:
        for handle in handles:
            handle.remove()
