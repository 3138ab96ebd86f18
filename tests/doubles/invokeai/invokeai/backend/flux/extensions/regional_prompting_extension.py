"""Double of ``RegionalPromptingExtension`` from ``invokeai/backend/flux/extensions/regional_prompting_extension.py``
(InvokeAI 6.14.2): it holds the text conditioning and the restricted attention mask (None without regional
masks), and hands the mask to every other block (even block indexes), None to the rest, as the release does.
Building it from regional prompts (``from_text_conditioning``) is not kept: the doubles' FLUX node has one
prompt and no mask, for which the release's mask is None."""
from typing import Any

import torch


class RegionalPromptingExtension:
    def __init__(self, regional_text_conditioning: Any, restricted_attn_mask: torch.Tensor | None = None):
        self.regional_text_conditioning = regional_text_conditioning
        self.restricted_attn_mask = restricted_attn_mask

    def get_double_stream_attn_mask(self, block_index: int) -> torch.Tensor | None:
        return (self.restricted_attn_mask, None)[block_index % 2]

    def get_single_stream_attn_mask(self, block_index: int) -> torch.Tensor | None:
        return (self.restricted_attn_mask, None)[block_index % 2]
