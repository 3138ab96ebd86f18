"""sd-scripts' HunyuanImage modules import the unified attention by name."""
from library.attention import AttentionParams, attention  # noqa: F401 - by name, as sd-scripts does


def call_attention(qkv, attn_params):
    return attention(qkv, attn_params=attn_params)
