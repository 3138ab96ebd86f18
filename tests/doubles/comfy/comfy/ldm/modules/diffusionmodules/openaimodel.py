"""Double of ComfyUI's comfy/ldm/modules/diffusionmodules/openaimodel.py: ``UNetModel`` with the real
one's block layout and its way of running the blocks. ``input_blocks`` (a ModuleList),
``middle_block`` and ``output_blocks`` hold ``TimestepEmbedSequential`` blocks, and the forward runs
each block through ``forward_timestep_embed``, which calls the block's layers one by one (the block
module itself is never called), after setting ``transformer_options["block"]`` to ("input", i),
("middle", 0) or ("output", i). Here one self-attention layer (input block 1) and one
cross-attention layer (output block 0), in tokens, without time embedding or skip connections."""
from torch import nn

from comfy.ldm.modules.attention import CrossAttention


class TimestepBlock(nn.Module):
    pass


class SpatialTransformer(nn.Module):
    """One attention layer on (B, L, C) tokens; ``context`` None: self-attention."""

    def __init__(self, attention, cross):
        super().__init__()
        self.attn = attention
        self.cross = cross

    def forward(self, x, context=None, transformer_options={}):
        return x + self.attn(x, context=context if self.cross else None, transformer_options=transformer_options)


def forward_timestep_embed(ts, x, emb, context=None, transformer_options={}, output_shape=None, time_context=None,
                           num_video_frames=None, image_only_indicator=None):
    for layer in ts:
        if isinstance(layer, TimestepBlock):
            x = layer(x, emb)
        elif isinstance(layer, SpatialTransformer):
            x = layer(x, context, transformer_options)
        else:
            x = layer(x)
    return x


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    def forward(self, *args, **kwargs):
        return forward_timestep_embed(self, *args, **kwargs)


class UNetModel(nn.Module):
    def __init__(self, channels=64, context_dim=32, heads=4):
        super().__init__()
        proj_in = nn.Linear(4, channels)
        attn1 = CrossAttention(channels, heads=heads, dim_head=channels // heads)
        attn2 = CrossAttention(channels, context_dim=context_dim, heads=heads, dim_head=channels // heads)
        proj_out = nn.Linear(channels, 4)
        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(proj_in),
                                           TimestepEmbedSequential(SpatialTransformer(attn1, cross=False))])
        self.middle_block = TimestepEmbedSequential(nn.Identity())
        self.output_blocks = nn.ModuleList([TimestepEmbedSequential(SpatialTransformer(attn2, cross=True)),
                                            TimestepEmbedSequential(proj_out)])

    def forward(self, x, timesteps=None, context=None, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        emb = None
        t = x.flatten(2).transpose(1, 2)
        for i, module in enumerate(self.input_blocks):
            transformer_options["block"] = ("input", i)
            t = forward_timestep_embed(module, t, emb, context, transformer_options)
        transformer_options["block"] = ("middle", 0)
        t = forward_timestep_embed(self.middle_block, t, emb, context, transformer_options)
        for i, module in enumerate(self.output_blocks):
            transformer_options["block"] = ("output", i)
            t = forward_timestep_embed(module, t, emb, context, transformer_options)
        return t.transpose(1, 2).reshape(b, c, h, w)
