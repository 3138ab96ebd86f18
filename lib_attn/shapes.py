"""The attention calls each supported model makes, derived from its architecture.

Every model is described by the facts of its reference configuration (channels,
levels, heads, depths, patch size, text tokens) and the calls are computed from
them, so a new resolution or a changed fact gives the right shapes without a
hand-written table.

A call is ``(b, heads, q_len, kv_len, head_dim)`` as the host passes it to the
attention kernel, with ``calls`` = how many such calls one denoising step makes
(for the VAE: one decode of one image). Attention FLOPs use the forward count
``4·b·h·q·kv·d`` (QKᵀ and PV, 2 FLOP per multiply-add; head_dim not padded).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

IMAGE_MODELS = ("sd15", "sd2", "sdxl", "sd3", "flux", "vae")
#: Video models, whose calls run to 30k-120k tokens: run when named, never by "all".
VIDEO_MODELS = ("wan", "hunyuan-video")
MODELS = IMAGE_MODELS + VIDEO_MODELS
MODEL_LABELS = {
    "sd15": "SD1.5",
    "sd2": "SD2.x",
    "sdxl": "SDXL",
    "sd3": "SD3-medium",
    "flux": "Flux.1-dev",
    "vae": "VAE decoder",
    "wan": "Wan 2.1/2.2 14B, 81 frames",
    "hunyuan-video": "HunyuanVideo, 129 frames",
}
# Resolution each model is trained for; the VAE default is the 1024² decode that
# SDXL, SD3 and Flux run, where its single 512-wide head is a memory hazard. A video
# model's resolution is its frame height (its ``VIDEO_SIZES`` width), every one of
# ``VIDEO_RES`` by default.
NATIVE_RES = {"sd15": 512, "sd2": 768, "sdxl": 1024, "sd3": 1024, "flux": 1024, "vae": 1024}
VIDEO_RES = {"wan": (480, 720), "hunyuan-video": (720,)}
#: Frame width for a height, as the models' own presets size them; other heights are 16:9.
VIDEO_SIZES = {480: 832, 544: 960, 720: 1280}

LATENT_FACTOR = 8  # every model here works on a latent of (H/8, W/8)


@dataclass(frozen=True)
class AttentionCall:
    """One kind of attention call of a model at one resolution.

    ``kind`` is "self" or "cross" (joint text+image attention of the DiTs is
    self-attention over the concatenated sequence); ``role`` is the engine role
    the host passes ("unet", "dit", "vae"); ``calls`` is the count per denoising
    step (per decoded image for the VAE).
    """

    model: str
    res: int
    where: str
    kind: str
    role: str
    b: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    calls: int

    @property
    def shape(self) -> Tuple[int, int, int, int, int]:
        return (self.b, self.heads, self.q_len, self.kv_len, self.head_dim)

    @property
    def flops(self) -> int:
        """Forward FLOPs of one call."""
        return attention_flops(*self.shape)

    @property
    def step_flops(self) -> int:
        return self.flops * self.calls


def attention_flops(b: int, heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """Forward attention FLOPs: QKᵀ and PV, each b·h·q·kv·d multiply-adds of 2 FLOP."""
    return 4 * b * heads * q_len * kv_len * head_dim


# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class UNetSpec:
    """The attention-relevant part of an LDM/SGM UNet configuration.

    ``attention_resolutions`` holds downsampling factors (1, 2, 4, ...) at which a
    level has transformers; each such level has ``num_res_blocks`` on the way down
    and ``num_res_blocks + 1`` on the way up, each with ``transformer_depth[level]``
    blocks of self- then cross-attention. The middle block sits at the deepest
    level with ``middle_depth`` blocks.
    Heads: a fixed ``num_heads`` (head_dim = channels / heads) or a fixed
    ``num_head_channels`` (heads = channels / 64).
    """

    model_channels: int
    channel_mult: Tuple[int, ...]
    attention_resolutions: Tuple[int, ...]
    num_res_blocks: int
    transformer_depth: Tuple[int, ...]
    middle_depth: int
    num_heads: Optional[int]
    num_head_channels: Optional[int]
    context_tokens: int
    batch: int  # cond and uncond batched together

    def heads_and_dim(self, channels: int) -> Tuple[int, int]:
        if self.num_heads is not None:
            return self.num_heads, channels // self.num_heads
        assert self.num_head_channels is not None
        return channels // self.num_head_channels, self.num_head_channels


@dataclass(frozen=True)
class DiTSpec:
    """A transformer denoiser with joint text+image attention in every block."""

    blocks: int  # all blocks that run one joint attention (double + single)
    heads: int
    head_dim: int
    patch: int
    text_tokens: int
    batch: int


@dataclass(frozen=True)
class VAESpec:
    """The KL-VAE decoder: one single-head AttnBlock in its middle block."""

    base_channels: int
    channel_mult: Tuple[int, ...]
    batch: int


@dataclass(frozen=True)
class VideoSpec:
    """A video DiT over (frames, height, width) latent patches. The VAE compresses time by
    ``time_stride`` (frame 0 alone, then groups) and space by 8; a patch is ``patch`` x ``patch``
    latent pixels of one latent frame. ``joint``: text and video tokens in one self-attention
    (HunyuanVideo's double and single blocks); else self-attention over the video tokens and
    cross-attention to the text (Wan). ``passes``: model calls per step (2 where the conditional
    and unconditional passes run one after the other, as Wan's reference code does)."""

    blocks: int
    heads: int
    head_dim: int
    patch: int
    time_stride: int
    frames: int
    text_tokens: int
    joint: bool
    passes: int


# CompVis v1-inference.yaml: 320 ch, mult 1/2/4/4, attention at ds 4/2/1, 8 fixed heads.
SD15 = UNetSpec(320, (1, 2, 4, 4), (4, 2, 1), 2, (1, 1, 1, 1), 1, 8, None, 77, 2)
# Stability-AI v2-inference(-v).yaml: same UNet with 64-channel heads.
SD2 = UNetSpec(320, (1, 2, 4, 4), (4, 2, 1), 2, (1, 1, 1, 1), 1, None, 64, 77, 2)
# sd_xl_base.yaml: mult 1/2/4, attention at ds 4/2, depth [1,2,10]; the middle block
# takes the last depth (10).
SDXL = UNetSpec(320, (1, 2, 4), (4, 2), 2, (1, 2, 10), 10, None, 64, 77, 2)
# MMDiT depth 24: 24 heads of 64; CLIP-L/G 77 + T5 77 context tokens (SAI reference).
SD3_MEDIUM = DiTSpec(blocks=24, heads=24, head_dim=64, patch=2, text_tokens=154, batch=2)
# flux-dev: hidden 3072, 24 heads, 19 double + 38 single blocks, T5 512 tokens,
# guidance-distilled, so no CFG batch.
FLUX_DEV = DiTSpec(blocks=19 + 38, heads=24, head_dim=3072 // 24, patch=2, text_tokens=512, batch=1)
# ddconfig ch 128, ch_mult 1/2/4/4: mid.attn_1 is AttnBlock(512).
VAE = VAESpec(base_channels=128, channel_mult=(1, 2, 4, 4), batch=1)

# Wan 2.1 14B (and each expert of Wan 2.2 A14B): dim 5120 in 40 heads, 40 blocks, Wan-VAE 4x8x8,
# patch (1, 2, 2), umT5 context 512 tokens; 81 frames. 480p: 21 x 30 x 52 = 32,760 tokens.
WAN_14B = VideoSpec(blocks=40, heads=40, head_dim=128, patch=2, time_stride=4, frames=81, text_tokens=512,
                    joint=False, passes=2)
# HunyuanVideo 13B: hidden 3072 in 24 heads, 20 double + 40 single blocks, causal 3D VAE 4x8x8, patch
# (1, 2, 2), 256 text tokens, guidance-distilled (one pass); 129 frames at 720p: 119,056 tokens.
HUNYUAN_VIDEO = VideoSpec(blocks=20 + 40, heads=24, head_dim=128, patch=2, time_stride=4, frames=129,
                          text_tokens=256, joint=True, passes=1)

SPECS = {"sd15": SD15, "sd2": SD2, "sdxl": SDXL, "sd3": SD3_MEDIUM, "flux": FLUX_DEV, "vae": VAE,
         "wan": WAN_14B, "hunyuan-video": HUNYUAN_VIDEO}
ROLES = {"sd15": "unet", "sd2": "unet", "sdxl": "unet", "sd3": "dit", "flux": "dit", "vae": "vae",
         "wan": "dit", "hunyuan-video": "dit"}


def _check_res(res: int, multiple: int) -> None:
    if not isinstance(res, int) or res <= 0 or res % multiple:
        raise ValueError(f"res must be a positive multiple of {multiple}, got {res!r}")


def _unet_calls(model: str, spec: UNetSpec, res: int) -> List[AttentionCall]:
    _check_res(res, LATENT_FACTOR)
    side = res // LATENT_FACTOR
    out: List[AttentionCall] = []

    def add(where: str, level_side: int, channels: int, n: int) -> None:
        heads, d = spec.heads_and_dim(channels)
        tokens = level_side * level_side
        for kind, kv in (("self", tokens), ("cross", spec.context_tokens)):
            out.append(AttentionCall(model, res, f"{kind} {where}", kind, "unet",
                                     spec.batch, heads, tokens, kv, d, n))

    level_side = side
    for level, mult in enumerate(spec.channel_mult):
        if 2 ** level in spec.attention_resolutions:
            blocks = spec.num_res_blocks + (spec.num_res_blocks + 1)  # down + up
            add(f"L{level}", level_side, spec.model_channels * mult,
                blocks * spec.transformer_depth[level])
        if level < len(spec.channel_mult) - 1:
            level_side = math.ceil(level_side / 2)  # stride-2 conv, padding 1
    add("mid", level_side, spec.model_channels * spec.channel_mult[-1], spec.middle_depth)
    return out


def _dit_calls(model: str, spec: DiTSpec, res: int) -> List[AttentionCall]:
    _check_res(res, LATENT_FACTOR * spec.patch)
    tokens = (res // (LATENT_FACTOR * spec.patch)) ** 2 + spec.text_tokens
    return [AttentionCall(model, res, "joint", "self", "dit", spec.batch, spec.heads,
                          tokens, tokens, spec.head_dim, spec.blocks)]


def _vae_calls(model: str, spec: VAESpec, res: int) -> List[AttentionCall]:
    _check_res(res, LATENT_FACTOR)
    tokens = (res // LATENT_FACTOR) ** 2
    channels = spec.base_channels * spec.channel_mult[-1]
    return [AttentionCall(model, res, "mid", "self", "vae", spec.batch, 1, tokens, tokens,
                          channels, 1)]


def _video_calls(model: str, spec: VideoSpec, res: int) -> List[AttentionCall]:
    step = LATENT_FACTOR * spec.patch
    _check_res(res, step)
    width = VIDEO_SIZES.get(res, round(res * 16 / 9 / step) * step)
    latent_frames = (spec.frames - 1) // spec.time_stride + 1
    video = latent_frames * (res // step) * (width // step)
    where = f"{res}p"
    if spec.joint:
        tokens = video + spec.text_tokens
        return [AttentionCall(model, res, f"joint {where}", "self", "dit", 1, spec.heads, tokens, tokens,
                              spec.head_dim, spec.blocks * spec.passes)]
    return [AttentionCall(model, res, f"{kind} {where}", kind, "dit", 1, spec.heads, video, kv, spec.head_dim,
                          spec.blocks * spec.passes)
            for kind, kv in (("self", video), ("cross", spec.text_tokens))]


def scaled_down(call: AttentionCall, factor: int) -> AttentionCall:
    """``call`` with its video tokens and its heads divided by ``factor`` (at least one of each), its
    text tokens kept: a long call brought within a CPU's reach, at the same head size. Calls of image
    models, and any call at factor 1, are returned as they are."""
    spec = SPECS[call.model]
    if factor == 1 or not isinstance(spec, VideoSpec):
        return call
    text = spec.text_tokens if spec.joint else 0
    q_len = max(1, (call.q_len - text) // factor) + text
    kv_len = q_len if call.kind == "self" else call.kv_len
    return AttentionCall(call.model, call.res, f"{call.where} ÷{factor}", call.kind, call.role, call.b,
                         max(1, call.heads // factor), q_len, kv_len, call.head_dim, call.calls)


def _merge_identical(calls: List[AttentionCall]) -> List[AttentionCall]:
    """Join calls of identical shape and kind (e.g. SDXL's level 2 and middle)."""
    merged: Dict[tuple, AttentionCall] = {}
    for c in calls:
        key = (c.kind, c.shape)
        if key in merged:
            m = merged[key]
            where = m.where + "+" + c.where.split(" ", 1)[-1]
            merged[key] = AttentionCall(m.model, m.res, where, m.kind, m.role, m.b, m.heads,
                                        m.q_len, m.kv_len, m.head_dim, m.calls + c.calls)
        else:
            merged[key] = c
    return list(merged.values())


def model_calls(model: str, res: Optional[int] = None) -> List[AttentionCall]:
    """The attention calls of ``model`` at ``res``×``res`` (default: its native size).

    Calls of identical shape and kind are merged, their counts added.
    """
    if model not in SPECS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {model!r}")
    spec = SPECS[model]
    if isinstance(spec, VideoSpec):
        return [c for r in ((res,) if res is not None else VIDEO_RES[model]) for c in _video_calls(model, spec, r)]
    res = NATIVE_RES[model] if res is None else res
    if isinstance(spec, UNetSpec):
        calls = _unet_calls(model, spec, res)
    elif isinstance(spec, DiTSpec):
        calls = _dit_calls(model, spec, res)
    else:
        calls = _vae_calls(model, spec, res)
    return _merge_identical(calls)


def calls_per_step(model: str, res: Optional[int] = None) -> int:
    return sum(c.calls for c in model_calls(model, res))


def step_flops(model: str, res: Optional[int] = None) -> int:
    """Attention FLOPs of one denoising step (one decode for the VAE)."""
    return sum(c.step_flops for c in model_calls(model, res))


# ------------------------------------------------------------ H200 floors
# Constants of performance.md §3.1: dense bf16/fp16 tensor peak, HBM3e bandwidth,
# MUFU exp throughput.
H200_TENSOR_FLOPS = 989e12
H200_HBM_BYTES_PER_S = 4.8e12
H200_EXP_PER_S = 3.9e12


def h200_floor_s(b: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                 element_bytes: int = 2) -> float:
    """Lower bound in seconds for one fused 16-bit attention call on an H200.

    The largest of: tensor-core time for the FLOPs, HBM time for reading Q, K, V
    and writing O once, and exp-unit time for the b·h·q·kv exponentials.
    """
    tensor = attention_flops(b, heads, q_len, kv_len, head_dim) / H200_TENSOR_FLOPS
    traffic = element_bytes * (2 * b * heads * q_len * head_dim + 2 * b * heads * kv_len * head_dim)
    hbm = traffic / H200_HBM_BYTES_PER_S
    exp = b * heads * q_len * kv_len / H200_EXP_PER_S
    return max(tensor, hbm, exp)
