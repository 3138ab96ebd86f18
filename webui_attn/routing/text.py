"""Where Forge's and Forge Neo's joint models put their text tokens, told to the engine
(``lib_attn.conditioning``) while sparse attention is on: each joint block reads its own call as it
starts, and its joint attention call (over text and image) gets them as kept conditioning tokens.

From their source (Forge 2025-06 and Forge Neo 2025-10, ``backend/nn/flux.py``; Neo's ``backend/nn/chroma.py``
too): the model's ``inner_forward`` calls every double block as ``block(img=img, txt=txt, ...)``, which joins
``torch.cat((txt_q, img_q), dim=2)`` (text first); then ``img = torch.cat((txt, img), 1)`` and every single
block as ``block(img, ...)``. A single block's call holds no text length of its own: it is the double
blocks' (the text keeps its length through them), kept from the model call's double blocks and told to a
single block whose sequence is their text and image together. A model call without double blocks tells
its single blocks nothing.

Their Wan attends over the video tokens alone (its text reaches cross-attention): nothing to tell. A1111
runs no joint model.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

from lib_attn import conditioning

MODULES = ("backend.nn.flux", "backend.nn.chroma")
_joint = conditioning.joint_reader(("img", 0), ("txt", 1), conditioning.FIRST)
#: The text the thread's last double block saw (the model call's single blocks come after it).
_last: ContextVar = ContextVar("attn_webui_last_text", default=None)


def _double(args, kwargs):
    found = _joint(args, kwargs)
    _last.set(found)
    return found


def _single(args, kwargs):
    found, x = _last.get(), kwargs.get("x", args[0] if args else None)
    if found is None or getattr(x, "dim", lambda: 0)() < 2 or x.shape[1] != found.total:
        return None
    return found


READERS = {"DoubleStreamBlock": _double, "SingleStreamBlock": _single}


def _reader(block):
    """The reader of a Forge-line Flux or Chroma block's call, or None for any other block."""
    return READERS.get(type(block).__name__) if type(block).__module__ in MODULES else None


def joint_blocks(model) -> list:
    """(block, reader) for the double then single blocks of a Forge-line Flux or Chroma ``model``."""
    return conditioning.readers(model, ("double_blocks", "single_blocks"), _reader)


@contextlib.contextmanager
def told(model):
    """While the ``with`` block runs, the joint blocks of ``model`` tell their text tokens."""
    _last.set(None)
    with conditioning.hooks(joint_blocks(model)) as count:
        yield count
