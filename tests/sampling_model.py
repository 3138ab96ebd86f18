"""A small denoiser in the layout of the ldm/sgm UNet (``input_blocks``, ``middle_block``,
``output_blocks``), built from the running webui double's own attention module, and the model object
each host's sampling reaches it through: A1111's ``sd_model.model.diffusion_model``, the Forge lines'
``sd_model.forge_objects.unet.model.diffusion_model``. It stands for the checkpoint, not for the host.
"""
from __future__ import annotations

import importlib
import zlib
from types import SimpleNamespace

import torch
from torch import nn

DIM, HEADS, TOKENS, CONTEXT = 32, 2, 16, 8
#: Attention calls per model call: a self- and a cross-attention in each of the five blocks.
CALLS_PER_MODEL_CALL = 10
#: mode -> the module whose ``CrossAttention`` the host's UNet uses (routed by the extension's adapter).
ATTENTION = {"a1111": "ldm.modules.attention", "forge": "backend.nn.unet", "neo": "backend.nn.unet",
             "reforge": "ldm_patched.ldm.modules.attention", "classic": "ldm_patched.ldm.modules.attention"}


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attn1 = attention.CrossAttention(DIM, None, HEADS, DIM // HEADS)
        self.attn2 = attention.CrossAttention(DIM, DIM, HEADS, DIM // HEADS)

    def forward(self, h, context):
        h = h + self.attn1(h)
        return h + self.attn2(h, context=context)


class UNet(nn.Module):
    """Two input blocks, a middle block, two output blocks: blocks 0-4 in forward order."""

    def __init__(self, attention):
        super().__init__()
        self.input_blocks = nn.ModuleList([Block(attention) for _ in range(2)])
        self.middle_block = Block(attention)
        self.output_blocks = nn.ModuleList([Block(attention) for _ in range(2)])

    def forward(self, x, timesteps, context):
        h = x
        for block in self.input_blocks:
            h = block(h, context)
        h = self.middle_block(h, context)
        for block in self.output_blocks:
            h = block(h, context)
        return h * 0.1


class Model:
    """What sampling reads of ``shared.sd_model``; ``apply_model`` runs the denoiser where the host keeps it
    (the Forge lines: ``forge_objects``, which Forge Neo deletes from a model it drops)."""

    def __init__(self, mode: str, unet: UNet, info):
        self.mode = mode
        self.sd_checkpoint_info = info
        if mode == "a1111":
            self.model = SimpleNamespace(diffusion_model=unet)
        else:
            self.forge_objects = SimpleNamespace(unet=SimpleNamespace(model=SimpleNamespace(diffusion_model=unet)),
                                                 vae=SimpleNamespace(decode=lambda latent: decode(mode, latent)))
        self.unet = unet

    def apply_model(self, x, t, cond):
        unet = self.unet if self.mode == "a1111" else self.forge_objects.unet.model.diffusion_model
        return unet(x, t, context=cond["c_crossattn"][0])

    def decode_first_stage(self, latent):
        """The VAE's decode (the Forge lines' ``decode_first_stage`` reads ``forge_objects.vae``)."""
        return decode(self.mode, latent) if self.mode == "a1111" else self.forge_objects.vae.decode(latent)

    @staticmethod
    def noise(seed: int):
        """A batch's starting latent for ``seed`` (the webui's ``p.rng``)."""
        return torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(seed))

    @staticmethod
    def get_learned_conditioning(prompts):
        """A prompt's conditioning, the same for every checkpoint here (fixed by its text)."""
        return torch.cat([torch.randn(1, CONTEXT, DIM, generator=torch.Generator().manual_seed(zlib.crc32(text.encode())))
                          for text in prompts])


def build(mode: str, name: str = "base", seed: int = 0, dtype=torch.float32) -> Model:
    """A model whose weights depend on ``seed`` only, loaded as checkpoint ``name`` (``sd_models.loaded``)."""
    from modules import sd_models

    torch.manual_seed(seed)
    unet = UNet(importlib.import_module(ATTENTION[mode])).to(dtype)
    info = sd_models.CheckpointInfo(name)
    model = Model(mode, unet, info)
    sd_models.loaded[info] = model
    return model


def save_checkpoint(mode: str, name: str, seed: int = 0):
    """A checkpoint file for the Forge lines' job doubles (``tests/doubles/forge_jobs``): registered as the
    webui lists the files it finds, and built anew by ``backend.loader.forge_loader`` at every load, with
    the weights ``seed`` fixes. Returns its ``CheckpointInfo``."""
    from backend import loader
    from modules import sd_models

    def load():
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            unet = UNet(importlib.import_module(ATTENTION[mode]))
        return Model(mode, unet, None)

    info = sd_models.CheckpointInfo(f"{name}.safetensors")
    loader.files[info.filename] = load
    info.register()
    return info


def select(name: str):
    """The checkpoint chosen at the top of the page (``main_entry.checkpoint_change``) and loaded."""
    from modules import sd_models
    from modules_forge import main_entry

    main_entry.checkpoint_change(name)
    return sd_models.forge_model_reload()[0]


def decode(mode: str, latent):
    """The VAE's attention over the result (one call), as each host's VAE block runs it."""
    x = latent[:1, :, :].reshape(1, TOKENS, DIM).permute(0, 2, 1).reshape(1, DIM, 4, 4)
    if mode in ("forge", "neo"):
        from backend.nn import vae
        return vae.attention_function_single_head_spatial(x, x, x)
    module = importlib.import_module("ldm.modules.diffusionmodules.model" if mode == "a1111"
                                     else "ldm_patched.ldm.modules.diffusionmodules.model")
    torch.manual_seed(1)
    block = module.AttnBlock(DIM).to(latent.dtype)
    with torch.no_grad():
        return block(x)


def generation(mode: str, outputs: list, seed: int = 5, dtype=torch.float32):
    """``p.sd_model`` for the processing double: txt2img's sampling (and the hires pass when asked) from a
    fixed noise and prompt, then the VAE; the result goes to ``outputs``."""
    def run(p):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, TOKENS, DIM, generator=gen).to(dtype)
        cond = torch.randn(1, CONTEXT, DIM, generator=gen).to(dtype)
        uncond = torch.randn(1, CONTEXT, DIM, generator=gen).to(dtype)
        with torch.no_grad():
            samples = p.sample(cond, uncond, x)
            outputs.append((samples, decode(mode, samples)))
    return run
