"""Double of ComfyUI 0.19.3's comfy/ldm/ace/ace_step15.py: imports ``optimized_attention`` by name;
``AceStepAttention`` repeats its key/value heads up to the query heads and calls it on
``(B, heads, L, d)`` with ``skip_reshape=True``, a sliding-window additive bias of shape
``(1, 1, L, L)`` for self-attention, and ``low_precision_attention=False``; no transformer options.
``AceStepDiTModel`` runs ``layers`` of self-attention (windowed) then cross-attention."""
import torch
from torch import nn

from comfy.ldm.modules.attention import optimized_attention


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
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        source = encoder_hidden_states if self.is_cross_attention and encoder_hidden_states is not None \
            else hidden_states
        kv_len = source.shape[1]
        key_states = self.k_proj(source).view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(source).view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        n_rep = self.num_heads // self.num_kv_heads
        if n_rep > 1:
            key_states = key_states.repeat_interleave(n_rep, dim=1)
            value_states = value_states.repeat_interleave(n_rep, dim=1)
        attn_bias = None
        if self.sliding_window is not None and not self.is_cross_attention:
            indices = torch.arange(q_len, device=query_states.device)
            in_window = torch.abs(indices.unsqueeze(1) - indices.unsqueeze(0)) <= self.sliding_window
            window_bias = torch.zeros((q_len, kv_len), device=query_states.device, dtype=query_states.dtype)
            window_bias.masked_fill_(~in_window, torch.finfo(query_states.dtype).min)
            attn_bias = window_bias.unsqueeze(0).unsqueeze(0)
        attn_output = optimized_attention(query_states, key_states, value_states, self.num_heads, attn_bias,
                                          skip_reshape=True, low_precision_attention=False)
        return self.o_proj(attn_output)


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
