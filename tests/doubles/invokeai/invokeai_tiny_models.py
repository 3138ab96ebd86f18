"""The models the InvokeAI double's model manager hands out: tiny, random (fixed seed), fp32, CPU.

What runs attention is real code: diffusers' ``UNet2DConditionModel`` (default ``AttnProcessor2_0``) and
``AutoencoderKL`` (mid-block attention) for SD1.5; InvokeAI's own FLUX.1 transformer
(``invokeai.backend.flux.model.Flux``, the installed release's file, whose blocks call
``invokeai.backend.flux.math.attention`` through ``custom_block_processor``); diffusers'
``QwenImageTransformer2DModel`` (its processors call ``dispatch_attention_fn``) for Qwen Image;
diffusers' ``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2`` for FLUX.2; InvokeAI's own
``Ideogram4Transformer`` pair for Ideogram 4. Only the
sizes are tiny. The text encoders are stand-ins: an embedding table over the prompt's bytes (text encoders
are not part of what an attention router serves).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from invokeai.backend.model_manager.load.load_base import LoadedModel
from invokeai.backend.model_manager.taxonomy import BaseModelType, ModelFormat, ModelType, SubModelType

#: Width of the stand-in text embeddings (and the cross-attention width of the tiny denoisers).
TEXT_DIM = 32
#: Tokens per prompt.
TEXT_TOKENS = 8
#: Width of FLUX's pooled (CLIP) vector.
FLUX_VEC_DIM = 16


class ByteTextEncoder(torch.nn.Module):
    """Prompt -> [1, TEXT_TOKENS, TEXT_DIM]: an embedding of the prompt's first bytes (0 pads)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, TEXT_DIM)
        self.pool = torch.nn.Linear(TEXT_DIM, FLUX_VEC_DIM)

    @staticmethod
    def token_ids(prompt: str) -> torch.Tensor:
        data = list(prompt.encode("utf-8")[:TEXT_TOKENS])
        return torch.tensor([data + [0] * (TEXT_TOKENS - len(data))])

    def forward(self, prompt: str) -> torch.Tensor:
        return self.embed(self.token_ids(prompt))

    def pooled(self, prompt: str) -> torch.Tensor:
        return self.pool(self.forward(prompt).mean(dim=1))


def _sd_unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_DIM, attention_head_dim=8, norm_num_groups=32,
    )


def _sd_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKL

    # Four blocks: the decoder upsamples 8x, as SD's VAE does.
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=32,
    )


def _sd_scheduler() -> object:
    from diffusers import EulerDiscreteScheduler

    # SD1.5's training schedule (scaled_linear betas, epsilon prediction).
    return EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  num_train_timesteps=1000)


def _flux_transformer() -> torch.nn.Module:
    from invokeai.backend.flux.model import Flux, FluxParams

    # 16 latent channels packed 2x2 -> 64 inputs; head dim 16 = sum(axes_dim).
    return Flux(FluxParams(in_channels=64, vec_in_dim=FLUX_VEC_DIM, context_in_dim=TEXT_DIM, hidden_size=32,
                           mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[4, 6, 6],
                           theta=10_000, qkv_bias=True, guidance_embed=False))


def _qwen_transformer() -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    # 4 latent channels packed 2x2 -> 16 inputs; head dim 16 = sum(axes_dims_rope).
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                       axes_dims_rope=(4, 6, 6))


def _flux2_transformer() -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    # The VAE's 8 latent channels packed 2x2 -> 32 inputs; head dim 16 = sum(axes_dims_rope), 4D positions.
    return Flux2Transformer2DModel(patch_size=1, in_channels=32, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                   timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)


def _flux2_vae() -> torch.nn.Module:
    from diffusers import AutoencoderKLFlux2

    # Mid-block attention in the encoder and the decoder (diffusers' Attention, AttnProcessor2_0), as FLUX.2's.
    return AutoencoderKLFlux2(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                              up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=8,
                              norm_num_groups=32, sample_size=32)


def _ideogram4_pair() -> torch.nn.Module:
    from invokeai.backend.ideogram4.modeling_ideogram4 import Ideogram4Config, Ideogram4Transformer
    from invokeai.backend.ideogram4.transformer_pair import Ideogram4TransformerPair

    # Text features TEXT_DIM wide; head dim 16 (2 x sum(mrope_section)).
    config = Ideogram4Config(emb_dim=32, num_layers=1, num_heads=2, intermediate_size=64, adanln_dim=16,
                             llm_features_dim=TEXT_DIM, mrope_section=(4, 2, 2))
    return Ideogram4TransformerPair(Ideogram4Transformer(config), Ideogram4Transformer(config))


#: (base, submodel) -> builder. A main model's submodels; a DiT main model has a transformer.
BUILDERS: dict[tuple[BaseModelType, Optional[SubModelType]], Callable[[], object]] = {
    (BaseModelType.StableDiffusion1, SubModelType.UNet): _sd_unet,
    (BaseModelType.StableDiffusion1, SubModelType.VAE): _sd_vae,
    (BaseModelType.StableDiffusion1, SubModelType.Scheduler): _sd_scheduler,
    (BaseModelType.StableDiffusion1, SubModelType.TextEncoder): ByteTextEncoder,
    (BaseModelType.Flux, SubModelType.Transformer): _flux_transformer,
    (BaseModelType.Flux, SubModelType.TextEncoder): ByteTextEncoder,
    (BaseModelType.Flux2, SubModelType.Transformer): _flux2_transformer,
    (BaseModelType.Flux2, SubModelType.VAE): _flux2_vae,
    (BaseModelType.Flux2, SubModelType.TextEncoder): ByteTextEncoder,
    (BaseModelType.Ideogram4, SubModelType.Transformer): _ideogram4_pair,
    (BaseModelType.Ideogram4, SubModelType.TextEncoder): ByteTextEncoder,
    (BaseModelType.QwenImage, SubModelType.Transformer): _qwen_transformer,
    (BaseModelType.QwenImage, SubModelType.TextEncoder): ByteTextEncoder,
}


@dataclass(frozen=True)
class ModelConfig:
    """What the release's model record holds that a node reads (key, hash, name, base, type, format)."""

    key: str
    hash: str
    name: str
    base: BaseModelType
    type: ModelType = ModelType.Main
    format: ModelFormat = ModelFormat.Diffusers


#: The installed models: one main model per family.
INSTALLED = (
    ModelConfig(key="tiny-sd15-key", hash="blake3:tiny-sd15", name="tiny-sd15", base=BaseModelType.StableDiffusion1),
    ModelConfig(key="tiny-flux-key", hash="blake3:tiny-flux", name="tiny-flux", base=BaseModelType.Flux),
    ModelConfig(key="tiny-flux2-key", hash="blake3:tiny-flux2", name="tiny-flux2", base=BaseModelType.Flux2),
    ModelConfig(key="tiny-ideogram4-key", hash="blake3:tiny-ideogram4", name="tiny-ideogram4",
                base=BaseModelType.Ideogram4),
    ModelConfig(key="tiny-qwen-image-key", hash="blake3:tiny-qwen-image", name="tiny-qwen-image",
                base=BaseModelType.QwenImage),
)


class ModelRecordStore:
    """``model_manager.store``: ``exists(key)``, ``get_model(key)`` (unknown key: an Exception as the release's
    "Unknown model" path reports it)."""

    def __init__(self, configs: tuple[ModelConfig, ...] = INSTALLED) -> None:
        self._configs = {c.key: c for c in configs}

    def exists(self, key: str) -> bool:
        return key in self._configs

    def get_model(self, key: str) -> ModelConfig:
        if key not in self._configs:
            raise Exception(f"Unknown model {key}")
        return self._configs[key]


class ModelLoader:
    """``model_manager.load``: builds each (model, submodel) once, with a fixed seed, and hands the same
    instance to every session, as the release's model cache does (sessions on one device share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, Optional[SubModelType]], object] = {}

    def load_model(self, config: ModelConfig, submodel_type: Optional[SubModelType] = None,
                   user_id: str = "system") -> LoadedModel:
        with self._lock:
            slot = (config.key, submodel_type)
            if slot not in self._cache:
                builder = BUILDERS.get((config.base, submodel_type))
                if builder is None:
                    raise Exception(f"No {submodel_type} in model {config.name} ({config.base.value})")
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    model = builder()
                if isinstance(model, torch.nn.Module):
                    # Built in fp32 already; inference only.
                    model = model.eval().requires_grad_(False)
                self._cache[slot] = model
            return LoadedModel(config, self._cache[slot])


class ModelManager:
    def __init__(self) -> None:
        self.store = ModelRecordStore()
        self.load = ModelLoader()
