"""Double of Forge's backend/nn/mmditx.py (SD3 / SD3.5): the module defines its own ``attention(q, k, v,
heads, mask=None)``, plain SDPA over ``(b, n, heads*d)``, and every block calls that module global by
name; it never imports ``backend.attention``. ``SelfAttention.pre_attention`` splits the fused qkv and
applies the optional QK norm; ``block_mixing`` runs one joint attention over the context and image
tokens (context first), and SD3.5 Medium's ``x_block_self_attn`` blocks a second one over the image
tokens alone. The adaLN modulation, MLP and the embedders are kept as far as the attention path needs.
"""
import torch
import torch.nn as nn


def attention(q, k, v, heads, mask=None):
    b, _, dim_head = q.shape
    dim_head //= heads
    q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def modulate(x, shift, scale):
    if shift is None:
        shift = torch.zeros_like(scale)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def split_qkv(qkv, head_dim):
    qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], 3, -1, head_dim).movedim(2, 0)
    return qkv[0], qkv[1], qkv[2]


def optimized_attention(qkv, num_heads):
    return attention(qkv[0], qkv[1], qkv[2], num_heads)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, pre_only=False, qk_norm=None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        if not pre_only:
            self.proj = nn.Linear(dim, dim)
        self.pre_only = pre_only
        if qk_norm == "ln":
            self.ln_q = nn.LayerNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
            self.ln_k = nn.LayerNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
        elif qk_norm is None:
            self.ln_q = nn.Identity()
            self.ln_k = nn.Identity()
        else:
            raise ValueError(qk_norm)

    def pre_attention(self, x):
        q, k, v = split_qkv(self.qkv(x), self.head_dim)
        q = self.ln_q(q).reshape(q.shape[0], q.shape[1], -1)
        k = self.ln_k(k).reshape(q.shape[0], q.shape[1], -1)
        return q, k, v

    def post_attention(self, x):
        assert not self.pre_only
        return self.proj(x)

    def forward(self, x):
        q, k, v = self.pre_attention(x)
        return self.post_attention(attention(q, k, v, self.num_heads))


class DismantledBlock(nn.Module):
    """A DiT block with gated adaLN conditioning (the pre_only and x_block_self_attn forms)."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, qkv_bias=False, pre_only=False, qk_norm=None,
                 x_block_self_attn=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(hidden_size, num_heads, qkv_bias, pre_only, qk_norm)
        self.x_block_self_attn = x_block_self_attn
        if x_block_self_attn:
            self.attn2 = SelfAttention(hidden_size, num_heads, qkv_bias, False, qk_norm)
        if not pre_only:
            self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
            hidden = int(hidden_size * mlp_ratio)
            self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden), nn.GELU(approximate="tanh"),
                                     nn.Linear(hidden, hidden_size))
        n_mods = 9 if x_block_self_attn else (6 if not pre_only else 2)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, n_mods * hidden_size))
        self.pre_only = pre_only

    def pre_attention(self, x, c):
        if not self.pre_only:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
            qkv = self.attn.pre_attention(modulate(self.norm1(x), shift_msa, scale_msa))
            return qkv, (x, gate_msa, shift_mlp, scale_mlp, gate_mlp)
        shift_msa, scale_msa = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.attn.pre_attention(modulate(self.norm1(x), shift_msa, scale_msa)), None

    def post_attention(self, attn, x, gate_msa, shift_mlp, scale_mlp, gate_mlp):
        x = x + gate_msa.unsqueeze(1) * self.attn.post_attention(attn)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))

    def pre_attention_x(self, x, c):
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = self.adaLN_modulation(c).chunk(9, dim=1)
        x_norm = self.norm1(x)
        qkv = self.attn.pre_attention(modulate(x_norm, shift_msa, scale_msa))
        qkv2 = self.attn2.pre_attention(modulate(x_norm, shift_msa2, scale_msa2))
        return qkv, qkv2, (x, gate_msa, shift_mlp, scale_mlp, gate_mlp, gate_msa2)

    def post_attention_x(self, attn, attn2, x, gate_msa, shift_mlp, scale_mlp, gate_mlp, gate_msa2):
        x = x + gate_msa.unsqueeze(1) * self.attn.post_attention(attn)
        x = x + gate_msa2.unsqueeze(1) * self.attn2.post_attention(attn2)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


def block_mixing(context, x, context_block, x_block, c):
    context_qkv, context_intermediates = context_block.pre_attention(context, c)
    if x_block.x_block_self_attn:
        x_qkv, x_qkv2, x_intermediates = x_block.pre_attention_x(x, c)
    else:
        x_qkv, x_intermediates = x_block.pre_attention(x, c)
    q, k, v = (torch.cat((context_qkv[i], x_qkv[i]), dim=1) for i in range(3))
    attn = attention(q, k, v, x_block.attn.num_heads)
    n_context = context_qkv[0].shape[1]
    context_attn, x_attn = attn[:, :n_context], attn[:, n_context:]
    context = None if context_block.pre_only else context_block.post_attention(context_attn, *context_intermediates)
    if x_block.x_block_self_attn:
        attn2 = attention(*x_qkv2, x_block.attn2.num_heads)
        x = x_block.post_attention_x(x_attn, attn2, *x_intermediates)
    else:
        x = x_block.post_attention(x_attn, *x_intermediates)
    return context, x


class JointBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, pre_only=False, qk_norm=None, x_block_self_attn=False):
        super().__init__()
        self.context_block = DismantledBlock(hidden_size, num_heads, pre_only=pre_only, qk_norm=qk_norm)
        self.x_block = DismantledBlock(hidden_size, num_heads, pre_only=False, qk_norm=qk_norm,
                                       x_block_self_attn=x_block_self_attn)

    def forward(self, context, x, c):
        return block_mixing(context, x, context_block=self.context_block, x_block=self.x_block, c=c)


class MMDiTX(nn.Module):
    """The joint blocks of SD3 (the last one's context stream is pre_only); embedders and the final
    layer reduced to linear maps of the tokens, which do not touch attention."""

    def __init__(self, hidden_size=64, num_heads=4, depth=2, context_dim=32, x_block_self_attn_layers=()):
        super().__init__()
        self.x_embedder = nn.Linear(hidden_size, hidden_size)
        self.context_embedder = nn.Linear(context_dim, hidden_size)
        self.joint_blocks = nn.ModuleList(
            JointBlock(hidden_size, num_heads, pre_only=i == depth - 1, x_block_self_attn=i in x_block_self_attn_layers)
            for i in range(depth))

    def forward(self, x, c, context):
        x, context = self.x_embedder(x), self.context_embedder(context)
        for block in self.joint_blocks:
            context, x = block(context, x, c=c)
        return x
