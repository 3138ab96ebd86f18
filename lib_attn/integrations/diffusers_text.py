"""Where diffusers' joint transformers put their text tokens, told to the engine (``lib_attn.conditioning``)
by their blocks while ``route`` has sparse attention in force: each joint block reads its own
``hidden_states`` and ``encoder_hidden_states`` as it starts, and its joint attention call (the one over
both, ``total`` tokens long) gets them as the kept conditioning tokens.

From diffusers' source (0.35 to 0.39):

* Flux (``FluxTransformer2DModel``): ``FluxAttnProcessor`` joins ``[encoder, image]`` in the double blocks,
  and ``FluxSingleTransformerBlock`` ``cat([encoder_hidden_states, hidden_states])``: text first in both.
* Qwen-Image (``QwenImageTransformer2DModel``): its processor joins ``[text, image]``: first.
* SD3 (``SD3Transformer2DModel``): ``JointAttnProcessor2_0`` appends the context after the image tokens:
  text last. SD3.5's second attention (``attn2``, the image alone) is no joint call: its length differs.
* HunyuanVideo (``HunyuanVideoTransformer3DModel``): its double blocks' processor appends the text after
  the video tokens, its single blocks ``cat([hidden_states, encoder_hidden_states])``: last in both. Its
  calls carry the text's padding as a key mask, which keeps them dense (sparse takes no mask).
* Wan (``WanTransformer3DModel``): self-attention over the video tokens alone; the text reaches the
  cross-attention. Nothing to tell.

Models not listed here are told nothing (their blocks' order is not known to the engine).
"""
from __future__ import annotations

import contextlib

from .. import conditioning

FIRST, LAST = conditioning.FIRST, conditioning.LAST
#: Model class -> (its joint block lists, where their attention puts the text).
MODELS = {
    "FluxTransformer2DModel": (("transformer_blocks", "single_transformer_blocks"), FIRST),
    "QwenImageTransformer2DModel": (("transformer_blocks",), FIRST),
    "SD3Transformer2DModel": (("transformer_blocks",), LAST),
    "HunyuanVideoTransformer3DModel": (("transformer_blocks", "single_transformer_blocks"), LAST),
}
#: A joint block's arguments: (name, position) of its image and of its text hidden states.
IMAGE, TEXT = ("hidden_states", 0), ("encoder_hidden_states", 1)


def joint_blocks(model) -> list:
    """(block, reader) for each joint block of ``model`` (a model class of ``MODELS``; else none)."""
    names, side = MODELS.get(type(model).__name__, ((), FIRST))
    read = conditioning.joint_reader(IMAGE, TEXT, side)
    return conditioning.readers(model, names, lambda block: read)


@contextlib.contextmanager
def told(models):
    """While the ``with`` block runs, the joint blocks of ``models`` ((model, role) pairs) tell their text."""
    with conditioning.hooks([pair for model, _ in models for pair in joint_blocks(model)]) as count:
        yield count
