"""SDXL's U-Net module of sd-scripts: CrossAttention without a processor hook."""
from library._cross_attention import CrossAttentionBase


class CrossAttention(CrossAttentionBase):
    def forward(self, hidden_states, context=None, mask=None):
        return self._paths(hidden_states, context, mask)
