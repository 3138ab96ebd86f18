"""SD1/SD2's U-Net module of sd-scripts: its CrossAttention has a processor hook, called first."""
from library._cross_attention import CrossAttentionBase


class CrossAttention(CrossAttentionBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.processor = None

    def forward(self, hidden_states, context=None, mask=None, **kwargs):
        if self.processor is not None:
            return self.processor(attn=self, hidden_states=hidden_states, encoder_hidden_states=context,
                                  attention_mask=mask, **kwargs)
        return self._paths(hidden_states, context, mask)
