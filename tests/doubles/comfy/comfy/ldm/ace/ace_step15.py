"""Double of ComfyUI 0.19.3's comfy/ldm/ace/ace_step15.py, written from the call's form alone.

Facts kept: the module imports ``optimized_attention`` by name. ``AceStepAttention(hidden_size,
num_heads, num_kv_heads, head_dim, is_cross_attention=False, sliding_window=None)`` has fewer key/value
heads than query heads and repeats each of them up to the query heads before the call, which is made on
``(B, heads, L, d)`` tensors as ``optimized_attention(q, k, v, heads, bias, skip_reshape=True,
low_precision_attention=False)``: no transformer options; ``bias`` is None for cross-attention and, for
windowed self-attention, an additive ``(1, 1, L, L)`` band (0 where ``|i - j| <= sliding_window``, the
dtype's lowest value elsewhere). The output comes back as ``(B, L, heads*d)``. ``AceStepDiTModel`` runs
``layers`` of windowed self-attention then cross-attention to the conditioning."""
import torch
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


def band_bias(length: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """The additive sliding-window bias: 0 inside the band, the lowest value of ``like``'s dtype outside."""
    positions = torch.arange(length, device=like.device)
    inside = (positions[:, None] - positions[None, :]).abs() <= width
    lowest = torch.tensor(torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device)
    return torch.where(inside, torch.zeros((), dtype=like.dtype, device=like.device), lowest)[None, None]


def heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, L, heads*d)`` to ``(B, heads, L, d)``."""
    b, n, _ = t.shape
    return t.reshape(b, n, heads, -1).permute(0, 2, 1, 3)


class AceStepAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, is_cross_attention=False, sliding_window=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.is_cross_attention, self.sliding_window = is_cross_attention, sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, position_embeddings=None):
        cross = self.is_cross_attention and encoder_hidden_states is not None
        memory = encoder_hidden_states if cross else hidden_states
        q = heads_first(self.q_proj(hidden_states), self.num_heads)
        group = self.num_heads // self.num_kv_heads      # query heads per key/value head
        k, v = (heads_first(proj(memory), self.num_kv_heads).repeat_interleave(group, dim=1)
                for proj in (self.k_proj, self.v_proj))
        windowed = self.sliding_window is not None and not self.is_cross_attention
        bias = band_bias(q.shape[2], self.sliding_window, q) if windowed else None
        out = optimized_attention(q, k, v, self.num_heads, bias, skip_reshape=True, low_precision_attention=False)
        return self.o_proj(out)


class AceStepDiTLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, sliding_window):
        super().__init__()
        self.self_attn = AceStepAttention(hidden_size, num_heads, num_kv_heads, head_dim, sliding_window=sliding_window)
        self.cross_attn = AceStepAttention(hidden_size, num_heads, num_kv_heads, head_dim, is_cross_attention=True)

    def forward(self, hidden_states, temb=None, encoder_hidden_states=None, position_embeddings=None):
        hidden_states = hidden_states + self.self_attn(hidden_states)
        return hidden_states + self.cross_attn(hidden_states, encoder_hidden_states)


class AceStepDiTModel(nn.Module):
    def __init__(self, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=3,
                 context_dim=32):
        super().__init__()
        self.proj_in = nn.Linear(4, hidden_size)
        self.condition_embedder = nn.Linear(context_dim, hidden_size)
        self.layers = nn.ModuleList([AceStepDiTLayer(hidden_size, num_heads, num_kv_heads, head_dim, sliding_window)
                                     for _ in range(num_layers)])
        self.proj_out = nn.Linear(hidden_size, 4)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        hidden = self.proj_in(x.flatten(2).transpose(1, 2))
        encoder = self.condition_embedder(context)
        for layer in self.layers:
            hidden = layer(hidden, encoder_hidden_states=encoder)
        return self.proj_out(hidden).transpose(1, 2).reshape(B, C, H, W)
