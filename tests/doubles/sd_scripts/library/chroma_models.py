"""sd-scripts' Chroma module imports Flux's attention and rope by name (``library/chroma_models.py``)."""
from .flux_models import apply_rope, attention  # noqa: F401 - by name, as sd-scripts does


def call_attention(q, k, v, pe, attn_mask=None):
    """What Chroma's blocks do: call the name bound in this module."""
    return attention(q, k, v, pe=pe, attn_mask=attn_mask)
