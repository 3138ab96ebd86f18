"""Double of Forge Neo's backend/nn/chroma.py: no binding of its own; its blocks call flux's ``attention``
with Chroma's attention mask and the transformer options."""
import torch

from backend.nn.flux import SingleStreamBlock, attention


class ChromaSingleStreamBlock(SingleStreamBlock):
    """Flux's single block as Chroma runs it: ``attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=...)``."""

    def forward(self, x, pe, attn_mask=None, transformer_options={}):
        qkv, mlp = torch.split(self.linear1(x), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        B, L, _ = qkv.shape
        q, k, v = qkv.view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        return x + self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
