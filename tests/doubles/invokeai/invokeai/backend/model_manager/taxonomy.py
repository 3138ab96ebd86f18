"""Double of ``invokeai/backend/model_manager/taxonomy.py`` (InvokeAI 6.14.2): the enums a node meets in model
identifiers, with the release's values. Only the members the doubles and node packs use are listed."""
from enum import Enum


class BaseModelType(str, Enum):
    Any = "any"
    StableDiffusion1 = "sd-1"
    StableDiffusion2 = "sd-2"
    StableDiffusion3 = "sd-3"
    StableDiffusionXL = "sdxl"
    StableDiffusionXLRefiner = "sdxl-refiner"
    Flux = "flux"
    Flux2 = "flux2"
    CogView4 = "cogview4"
    ZImage = "z-image"
    QwenImage = "qwen-image"
    Anima = "anima"
    Krea2 = "krea-2"
    Wan = "wan"
    Ideogram4 = "ideogram-4"


class ModelType(str, Enum):
    Main = "main"
    VAE = "vae"
    LoRA = "lora"
    T5Encoder = "t5_encoder"
    CLIPEmbed = "clip_embed"
    QwenVLEncoder = "qwen_vl_encoder"


class SubModelType(str, Enum):
    UNet = "unet"
    Transformer = "transformer"
    Transformer2 = "transformer_2"
    TextEncoder = "text_encoder"
    TextEncoder2 = "text_encoder_2"
    Tokenizer = "tokenizer"
    Tokenizer2 = "tokenizer_2"
    VAE = "vae"
    Scheduler = "scheduler"


class ModelFormat(str, Enum):
    Diffusers = "diffusers"
    Checkpoint = "checkpoint"
    GGUFQuantized = "gguf_quantized"
