"""Double of ComfyUI's comfy/ldm/wan/model.py: imports ``optimized_attention`` by name and calls it with
``heads=`` and the transformer options on ``(b, s, heads*d)`` tensors."""
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, transformer_options={}):
        return self.o(optimized_attention(self.q(x), self.k(x), self.v(x), heads=self.num_heads,
                                          transformer_options=transformer_options))


class WanAttentionBlock(nn.Module):
    """Self-attention with the transformer options, then the ``attn2_patch`` patches the options carry,
    each called as ``p({"x": x, "transformer_options": transformer_options})`` (MultiTalk's audio
    attention comes in this way); no cross-attention, norms or modulation."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.self_attn = WanSelfAttention(dim, num_heads)

    def forward(self, x, transformer_options={}):
        patches = transformer_options.get("patches", {})
        x = x + self.self_attn(x, transformer_options=transformer_options)
        if "attn2_patch" in patches:
            for p in patches["attn2_patch"]:
                x = p({"x": x, "transformer_options": transformer_options})
        return x


class WanModel(nn.Module):
    """``blocks`` of ``WanAttentionBlock`` on the latent's tokens, with ``transformer_options["block_index"]``
    set before each block."""

    def __init__(self, dim=32, num_heads=4, num_layers=2):
        super().__init__()
        self.patch_embedding = nn.Linear(4, dim)
        self.blocks = nn.ModuleList([WanAttentionBlock(dim, num_heads) for _ in range(num_layers)])
        self.head = nn.Linear(dim, 4)

    def run_blocks(self, x, transformer_options):
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            x = block(x, transformer_options=transformer_options)
            x = self.after_block(i, x)
        return x

    def after_block(self, i, x):
        return x

    def forward(self, x, timesteps, context=None, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        t = self.run_blocks(self.patch_embedding(x.flatten(2).transpose(1, 2)), transformer_options)
        return self.head(t).transpose(1, 2).reshape(B, C, H, W)
