"""Double of Forge's backend/nn/chroma.py: binds ``attention_function`` (unused) and calls flux's ``attention``."""
from backend.attention import attention_function  # noqa: F401  (bound by name, as in Forge)
from backend.nn.flux import attention


def chroma_attention(q, k, v, pe):
    return attention(q, k, v, pe)
