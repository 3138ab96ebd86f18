"""Double of ComfyUI's comfy/sd.py ``VAE``: ``first_stage_model`` holds the attention blocks; ``decode``,
``decode_tiled``, ``encode``, ``encode_tiled``. ComfyUI keeps a loaded VAE object and hands the same one
to every graph that uses it."""
import torch

import comfy.ldm.wan.vae  # noqa: F401  (the real one imports every VAE's module)
import comfy.model_base  # noqa: F401
from comfy.ldm.modules.diffusionmodules.model import Decoder


class VAE:
    def __init__(self, first_stage_model=None):
        self.first_stage_model = first_stage_model if first_stage_model is not None else Decoder()

    def decode(self, samples_in, vae_options={}):
        with torch.no_grad():
            return self.first_stage_model(samples_in).movedim(1, -1)

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None):
        return self.decode(samples)

    def encode(self, pixel_samples):
        with torch.no_grad():
            return self.first_stage_model.mid_attn_1(pixel_samples.movedim(-1, 1))

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None):
        return self.encode(pixel_samples)
