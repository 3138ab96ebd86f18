"""Double of ComfyUI 0.19.3's comfy/ldm/wan/model_animate.py: imports ``optimized_attention`` by name;
``FaceBlock`` calls it with ``heads=`` on a query of ``(B*T, S, heads*d)`` and keys/values of
``(B*T, N, heads, d)`` (no ``skip_reshape``: ComfyUI's functions view every input as
``(b, -1, heads, d)``), and no transformer options. ``AnimateWanModel`` is a ``WanModel`` whose face
adapter runs a face block after every other Wan block, on motion tokens of ``(B, T, N, C)``."""
import torch
from torch import nn

from comfy.ldm.modules.attention import optimized_attention

from .model import WanModel


class FaceBlock(nn.Module):
    def __init__(self, hidden_size, heads_num):
        super().__init__()
        self.heads_num = heads_num
        self.linear1_kv = nn.Linear(hidden_size, hidden_size * 2)
        self.linear1_q = nn.Linear(hidden_size, hidden_size)
        self.linear2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x, motion_vec, motion_mask=None):
        B, T, N, C = motion_vec.shape
        H = self.heads_num
        k, v = self.linear1_kv(motion_vec).view(B, T, N, 2, H, C // H).permute(3, 0, 1, 2, 4, 5)
        q = self.linear1_q(x).view(B, -1, H, C // H)
        k, v = k.reshape(B * T, N, H, C // H), v.reshape(B * T, N, H, C // H)
        q = q.reshape(B * T, -1, C)
        attn = optimized_attention(q, k, v, heads=self.heads_num)
        return self.linear2(attn.reshape(B, -1, C))


class FaceAdapter(nn.Module):
    def __init__(self, hidden_dim, heads_num, num_adapter_layers):
        super().__init__()
        self.fuser_blocks = nn.ModuleList([FaceBlock(hidden_dim, heads_num) for _ in range(num_adapter_layers)])


class AnimateWanModel(WanModel):
    def __init__(self, dim=32, num_heads=4, num_layers=2, frames=2, motion_tokens=3):
        super().__init__(dim, num_heads, num_layers)
        self.face_adapter = FaceAdapter(dim, num_heads, (num_layers + 1) // 2)
        self.motion = nn.Parameter(torch.randn(1, frames, motion_tokens, dim))

    def after_block(self, i, x):
        if i % 2 == 0:
            x = x + self.face_adapter.fuser_blocks[i // 2](x, self.motion.expand(x.shape[0], -1, -1, -1))
        return x
