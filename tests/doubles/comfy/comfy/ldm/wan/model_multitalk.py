"""Double of ComfyUI 0.19.3's comfy/ldm/wan/model_multitalk.py: imports ``optimized_attention`` by name;
``SingleStreamAttention`` calls it on ``(B*T, heads, S, d)`` with ``heads=``, ``skip_reshape=True`` and
``skip_output_reshape=True``, and no transformer options. ``MultiTalkCrossAttnPatch`` is the
``attn2_patch`` the MultiTalk nodes add: called with the block's ``x`` and transformer options, it adds
the audio attention of the block (``transformer_options["block_index"]``) on ``audio_embeds``."""
import torch

from comfy.ldm.modules.attention import optimized_attention


class SingleStreamAttention(torch.nn.Module):
    def __init__(self, dim, encoder_hidden_states_dim, num_heads):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.q_linear = torch.nn.Linear(dim, dim)
        self.kv_linear = torch.nn.Linear(encoder_hidden_states_dim, dim * 2)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, encoder_hidden_states, shape=None, x_ref_attn_map=None):
        N_t = shape[0]
        B = x.shape[0]
        S = x.shape[1] // N_t
        x = x.view(B * N_t, S, self.dim)
        q = self.q_linear(x).view(B * N_t, S, self.num_heads, self.head_dim)
        kv = self.kv_linear(encoder_hidden_states)
        encoder_k, encoder_v = kv.view(B * N_t, encoder_hidden_states.shape[1], 2, self.num_heads,
                                       self.head_dim).unbind(2)
        x = optimized_attention(q.transpose(1, 2), encoder_k.transpose(1, 2), encoder_v.transpose(1, 2),
                                heads=self.num_heads, skip_reshape=True, skip_output_reshape=True).transpose(1, 2)
        x = self.proj(x.reshape(B * N_t, S, self.dim))
        return x.view(B, N_t * S, self.dim)


class MultiTalkCrossAttnPatch:
    def __init__(self, audio_cross_attn, audio_scale=1.0):
        self.audio_cross_attn = audio_cross_attn   # one SingleStreamAttention per Wan block
        self.audio_scale = audio_scale

    def __call__(self, kwargs):
        transformer_options = kwargs.get("transformer_options", {})
        block_idx = transformer_options.get("block_index", None)
        x = kwargs["x"]
        if block_idx is None:
            return torch.zeros_like(x)
        audio_embeds = transformer_options.get("audio_embeds")
        x_audio = self.audio_cross_attn[block_idx](x, audio_embeds.to(x.dtype), shape=transformer_options["grid_sizes"])
        return x + x_audio * self.audio_scale
