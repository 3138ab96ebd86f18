"""Where ComfyUI's joint blocks put their text tokens, told to the engine (``lib_attn.conditioning``) while
a routed model samples with sparse attention on: each joint block reads its own call as it starts, and
its joint attention call (over text and image, ``total`` tokens) gets them as kept conditioning tokens.

From ComfyUI's source (0.19.3), by block class, whatever model holds it:

* ``comfy.ldm.flux.layers.DoubleStreamBlock`` (Flux, Chroma, HunyuanVideo, Hunyuan3D): called with
  ``img=`` and ``txt=``; it joins ``cat((txt_q, img_q))``: text first.
* ``comfy.ldm.flux.layers.SingleStreamBlock``: called on the joined sequence; Flux, Chroma and
  HunyuanVideo put ``transformer_options["img_slice"] = [txt.shape[1], img.shape[1]]`` (the image tokens
  from the text's end to the sequence's) before their single blocks: text first, that many tokens. Where no
  ``img_slice`` reaches the block (Hunyuan3D) nothing is told.
* ``comfy.ldm.modules.diffusionmodules.mmdit.JointBlock`` (SD3): called as ``(context, x, ...)``; it joins
  ``cat((context_qkv, x_qkv))``: text first (the model's register tokens, prepended to the context, count
  with it). SD3.5's second attention over the image alone is no joint call: its length differs.

ComfyUI's Wan attends over the video tokens alone (its text reaches cross-attention): nothing to tell.
The override itself is not told: ``img_slice`` reaches it for single blocks only, set on a copy of the
options for double blocks (for their ``attn1_patch``) and never passed on to the attention call.
"""
from __future__ import annotations

import contextlib

from lib_attn import conditioning

FIRST = conditioning.FIRST


def _single(args, kwargs):
    """A single block's text from the ``img_slice`` its model put in the options: the image from the
    text's end to the sequence's end (text first), checked against the block's own sequence."""
    options = kwargs.get("transformer_options")
    found = options.get("img_slice") if isinstance(options, dict) else None
    x = kwargs.get("x", args[0] if args else None)
    if not isinstance(found, (list, tuple)) or len(found) != 2 or getattr(x, "dim", lambda: 0)() < 2:
        return None
    start, stop = found
    if not isinstance(start, int) or stop != x.shape[1] or not 0 < start <= stop:
        return None
    return conditioning.Text(start, stop, FIRST)


#: (module, class) of a joint block -> the reader of its call.
READERS = {
    ("comfy.ldm.flux.layers", "DoubleStreamBlock"): conditioning.joint_reader(("img", 0), ("txt", 1), FIRST),
    ("comfy.ldm.flux.layers", "SingleStreamBlock"): _single,
    ("comfy.ldm.modules.diffusionmodules.mmdit", "JointBlock"): conditioning.joint_reader(("x", 1), ("context", 0),
                                                                                         FIRST),
}
BLOCK_LISTS = ("double_blocks", "single_blocks", "joint_blocks")


def joint_blocks(diffusion_model) -> list:
    """(block, reader) for each block of ``diffusion_model`` whose class ``READERS`` knows."""
    return conditioning.readers(diffusion_model, BLOCK_LISTS,
                                lambda block: READERS.get((type(block).__module__, type(block).__name__)))


@contextlib.contextmanager
def told(diffusion_model):
    """While the ``with`` block runs, the joint blocks of ``diffusion_model`` tell their text tokens."""
    with conditioning.hooks(joint_blocks(diffusion_model)) as count:
        yield count
