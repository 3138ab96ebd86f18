"""Double of Forge Neo's backend/nn/qwen.py: binds ``attention_pytorch`` (``attention_xformers`` when
xformers is enabled) as ``attention_function``, not the chosen function, and calls it on the joint
text+image stream: ``attention_function(joint_query, joint_key, joint_value, self.heads, attention_mask)``."""
import torch
from torch import nn

from backend.memory_management import xformers_enabled

if xformers_enabled():
    from backend.attention import attention_xformers as attention_function
else:
    from backend.attention import attention_pytorch as attention_function


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        seq_txt = encoder_hidden_states.shape[1]
        img = [p(hidden_states).unflatten(-1, (self.heads, -1)) for p in (self.to_q, self.to_k, self.to_v)]
        txt = [p(encoder_hidden_states).unflatten(-1, (self.heads, -1))
               for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj)]
        joint = [torch.cat([t, i], dim=1).flatten(start_dim=2) for t, i in zip(txt, img)]
        out = attention_function(joint[0], joint[1], joint[2], self.heads, attention_mask)
        return self.to_out(out[:, seq_txt:]), out[:, :seq_txt]
