"""Double of modules/models/sd3/other_impls.py: the SDPA wrapper SD3's MMDiT and text encoders share."""
import torch


def attention(q, k, v, heads, mask=None):
    """(b, n, heads*d) in and out; SDPA on (b, h, n, d) views."""
    b, _, dim_head = q.shape
    dim_head //= heads
    q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)
