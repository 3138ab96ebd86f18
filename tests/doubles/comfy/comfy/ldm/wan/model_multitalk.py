"""Double of ComfyUI 0.19.3's comfy/ldm/wan/model_multitalk.py, written from the call's form alone.

Facts kept: the module imports ``optimized_attention`` by name. ``SingleStreamAttention(dim,
encoder_hidden_states_dim, num_heads)`` attends each frame's tokens to that frame's audio tokens: ``x``
of ``(B, T*S, dim)`` (``T``, the frames, is ``shape[0]``) against ``encoder_hidden_states`` of
``(B*T, A, encoder_hidden_states_dim)``, in one call on ``(B*T, heads, S, d)`` queries and ``(B*T,
heads, A, d)`` keys and values: ``optimized_attention(q, k, v, heads=heads, skip_reshape=True,
skip_output_reshape=True)``, no transformer options; the output is projected back to ``(B, T*S, dim)``.
``MultiTalkCrossAttnPatch(audio_cross_attn, audio_scale=1.0)`` is the ``attn2_patch`` the MultiTalk
nodes add to Wan: called with ``{"x": …, "transformer_options": …}``, it returns ``x`` plus the audio
attention of the block ``transformer_options["block_index"]`` names (on ``audio_embeds``, over
``grid_sizes``) times the scale, and zeros where no block is named."""
import torch

from comfy.ldm.modules.attention import optimized_attention


class SingleStreamAttention(torch.nn.Module):
    def __init__(self, dim, encoder_hidden_states_dim, num_heads):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.q_linear = torch.nn.Linear(dim, dim)
        self.kv_linear = torch.nn.Linear(encoder_hidden_states_dim, dim * 2)
        self.proj = torch.nn.Linear(dim, dim)

    def _split_heads(self, t):
        """``(frames, tokens, heads*d)`` to ``(frames, heads, tokens, d)``."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x, encoder_hidden_states, shape=None, x_ref_attn_map=None):
        batch, frames = x.shape[0], shape[0]
        per_frame = x.reshape(batch * frames, -1, self.dim)
        keys, values = self.kv_linear(encoder_hidden_states).chunk(2, dim=-1)
        out = optimized_attention(self._split_heads(self.q_linear(per_frame)), self._split_heads(keys),
                                  self._split_heads(values), heads=self.num_heads, skip_reshape=True,
                                  skip_output_reshape=True)
        out = out.transpose(1, 2).flatten(2)           # (frames, tokens, dim)
        return self.proj(out).reshape(batch, -1, self.dim)


class MultiTalkCrossAttnPatch:
    def __init__(self, audio_cross_attn, audio_scale=1.0):
        self.audio_cross_attn = audio_cross_attn   # one SingleStreamAttention per Wan block
        self.audio_scale = audio_scale

    def __call__(self, kwargs):
        x, options = kwargs["x"], kwargs.get("transformer_options", {})
        block = options.get("block_index")
        if block is None:
            return torch.zeros_like(x)
        audio = options.get("audio_embeds").to(x.dtype)
        return x + self.audio_scale * self.audio_cross_attn[block](x, audio, shape=options["grid_sizes"])
