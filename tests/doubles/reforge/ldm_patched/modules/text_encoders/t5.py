"""Double of reForge's ldm_patched/modules/text_encoders/t5.py: asks ``optimized_attention_for_device``
for its function per forward (small input: SDPA or basic) and passes the relative-position bias."""
from ldm_patched.ldm.modules.attention import optimized_attention_for_device


def self_attention(q, k, v, num_heads, bias):
    optimized_attention = optimized_attention_for_device(q.device, mask=bias is not None, small_input=True)
    return optimized_attention(q, k * ((k.shape[-1] / num_heads) ** 0.5), v, num_heads, bias)
