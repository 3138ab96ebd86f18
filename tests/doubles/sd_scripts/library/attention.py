"""sd-scripts' unified attention (``library/attention.py``), modes torch and flash.

Facts it keeps: q, k, v are (B, L, H, D) (or a list of them, which is cleared); the result is
(B, L, H*D). A mask covers the text tokens only; the valid length of a sample is its mask's sum plus
the image tokens, which come first. Equal lengths trim the call and pad the result with zeros;
``split_attn`` runs each sample on its valid length and pads with zeros; otherwise the torch mode
passes a (B, 1, 1, L) bool mask and the flash mode runs the varlen kernel over segments
[valid tokens][padding] of each sample (cu_seqlens), padding attending to padding.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def flash_attn_func(q, k, v, dropout_p=0.0):
    """flash-attn's dense call on (B, L, H, D)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          dropout_p=dropout_p).transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
    """What flash-attn's varlen kernel computes on packed (T, H, D): each segment attends within itself."""
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = flash_attn_func(q[None, start:end], k[None, start:end], v[None, start:end], dropout_p)[0]
    return out


@dataclass
class AttentionParams:
    attn_mode: Optional[str] = None
    split_attn: bool = False
    img_len: Optional[int] = None
    attention_mask: Optional[torch.Tensor] = None
    seqlens: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: Optional[int] = None

    @property
    def supports_fp32(self) -> bool:
        return self.attn_mode != "flash"

    @staticmethod
    def create_attention_params(attn_mode, split_attn):
        return AttentionParams(attn_mode, split_attn)

    @staticmethod
    def create_attention_params_from_mask(attn_mode, split_attn, img_len, attention_mask):
        if attention_mask is None:
            return AttentionParams(attn_mode, split_attn)
        seqlens = attention_mask.sum(dim=1).to(torch.int32) + img_len
        max_seqlen = attention_mask.shape[1] + img_len
        if split_attn:
            return AttentionParams(attn_mode, True, img_len, attention_mask, seqlens, None, max_seqlen)
        batch = attention_mask.shape[0]
        edges = []
        for i in range(batch):
            edges += [i * max_seqlen + int(seqlens[i]), (i + 1) * max_seqlen]
        cu_seqlens = torch.tensor([0] + edges, dtype=torch.int32, device=attention_mask.device)
        full = F.pad(attention_mask, (img_len, 0), value=1)
        if attn_mode == "torch":
            full = full[:, None, None, :].to(torch.bool)
        return AttentionParams(attn_mode, False, img_len, full, seqlens, cu_seqlens, max_seqlen)


def _pad_rows(x, length, dim):
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, length - x.shape[dim]]
    return F.pad(x, pad)


def attention(qkv_or_q, k=None, v=None, attn_params=None, drop_rate=0.0):
    if isinstance(qkv_or_q, list):
        q, k, v = qkv_or_q
        qkv_or_q.clear()
    else:
        q = qkv_or_q
        assert k is not None and v is not None, "k and v must be provided if qkv_or_q is a tensor"
    p = attn_params if attn_params is not None else AttentionParams.create_attention_params("torch", False)
    trimmed_to = None
    if not p.split_attn and p.attention_mask is not None and p.seqlens is not None and bool((p.seqlens == p.seqlens[0]).all()):
        valid = int(p.seqlens[0].item())
        q, k, v = q[:, :valid], k[:, :valid], v[:, :valid]
        trimmed_to = p.max_seqlen
        p = AttentionParams.create_attention_params(p.attn_mode, False)
    heads_first = p.attn_mode == "torch"
    if p.split_attn:
        lengths = p.seqlens.tolist() if p.seqlens is not None else [q.shape[1]] * q.shape[0]
        width = p.max_seqlen if p.seqlens is not None else q.shape[1]
        outs = []
        for i, n in enumerate(lengths):
            qi, ki, vi = q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n]
            if heads_first:
                xi = F.scaled_dot_product_attention(qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2),
                                                    dropout_p=drop_rate).transpose(1, 2)
            else:
                xi = flash_attn_func(qi, ki, vi, drop_rate)
            outs.append(_pad_rows(xi, width, 1))
        x = torch.cat(outs, dim=0)
    elif heads_first:
        x = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=p.attention_mask, dropout_p=drop_rate).transpose(1, 2)
    elif p.attn_mode == "flash":
        if p.cu_seqlens is None:
            x = flash_attn_func(q, k, v, drop_rate)
        else:
            b, n = q.shape[:2]
            packed = [t.reshape(b * n, *t.shape[2:]) for t in (q, k, v)]
            x = flash_attn_varlen_func(*packed, p.cu_seqlens, p.cu_seqlens, p.max_seqlen, p.max_seqlen, drop_rate)
            x = x.reshape(b, n, *x.shape[1:])
    else:
        raise ValueError(f"Unsupported attention mode: {p.attn_mode}")
    x = x.reshape(x.shape[0], x.shape[1], -1)
    if trimmed_to is not None:
        x = _pad_rows(x, trimmed_to, 1)
    return x
