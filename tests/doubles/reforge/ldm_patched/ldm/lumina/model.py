"""Double of reForge's ldm_patched/ldm/lumina/model.py: imports ``optimized_attention_masked`` by name and
calls it on (b, heads, s, d) tensors with the caption mask and ``skip_reshape=True``."""
from ldm_patched.ldm.modules.attention import optimized_attention_masked


def joint_attention(xq, xk, xv, n_heads, x_mask):
    """xq/xk/xv (b, s, heads, d) as Lumina holds them."""
    return optimized_attention_masked(xq.movedim(1, 2), xk.movedim(1, 2), xv.movedim(1, 2), n_heads, x_mask,
                                      skip_reshape=True)
