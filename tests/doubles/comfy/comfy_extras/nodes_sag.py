"""Double of ComfyUI 0.19.3's comfy_extras/nodes_sag.py, which ComfyUI loads as a module named by
its path less ``.py`` (``nodes.load_custom_node``): imports ``optimized_attention`` by name, and
the attention SAG puts in place of the UNet's middle self-attention (``attn_and_record``, an
``attn1`` replacement called as ``(q, k, v, extra_options)``) calls it with ``heads=`` and
``attn_precision``, and no transformer options, on the calls it does not record."""
from comfy.ldm.modules.attention import optimized_attention


def attn_and_record(q, k, v, extra_options):
    heads = extra_options["n_heads"]
    return optimized_attention(q, k, v, heads=heads, attn_precision=extra_options["attn_precision"])
