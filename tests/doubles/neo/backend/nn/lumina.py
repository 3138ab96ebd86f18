"""Double of the neo line's backend/nn/lumina.py (Lumina 2 / Z-Image): binds ``attention_pytorch``
(``attention_xformers`` with xformers) as ``attention_function`` and calls it with ``skip_reshape=True``
on (b, heads, s, d) tensors, the caption's mask as the fifth argument and the transformer options."""
from torch import nn

from backend.memory_management import xformers_enabled

if xformers_enabled():
    from backend.attention import attention_xformers as attention_function
else:
    from backend.attention import attention_pytorch as attention_function


class JointAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_local_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, x_mask, freqs_cis=None, transformer_options={}):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = (t.view(bsz, seqlen, self.n_local_heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        output = attention_function(xq.movedim(1, 2), xk.movedim(1, 2), xv.movedim(1, 2), self.n_local_heads, x_mask,
                                    skip_reshape=True, transformer_options=transformer_options)
        return self.out(output)
