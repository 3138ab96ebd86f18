"""Double of Forge Neo's backend/args.py: the one parser (extended by modules/cmd_args), parsed at import.

Neo's precision rule reads ``args.dont_upcast_attention``, which this parser does not define (Neo has
``--disable-attention-upcast``): reading it raises AttributeError, as in Neo.
"""
import argparse
import enum
import sys


class EnumAction(argparse.Action):
    """Parses a flag's value into the Enum given as ``type``."""

    def __init__(self, **kwargs):
        enum_type = kwargs.pop("type", None)
        kwargs.setdefault("choices", tuple(e.value for e in enum_type))
        super().__init__(**kwargs)
        self._enum = enum_type

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self._enum(values))


class SageAttentionFuncs(enum.Enum):
    auto = "auto"
    fp16_triton = "fp16_triton"
    fp16_cuda = "fp16_cuda"
    fp8_cuda = "fp8_cuda"


class Sage_quantization_backend(enum.Enum):
    cuda = "cuda"
    triton = "triton"


class Sage_qk_quant_gran(enum.Enum):
    per_warp = "per_warp"
    per_thread = "per_thread"


class Sage_pv_accum_dtype(enum.Enum):
    fp16 = "fp16"
    fp32 = "fp32"
    fp16_fp32 = "fp16+fp32"
    fp32_fp32 = "fp32+fp32"


parser = argparse.ArgumentParser()

attn_group = parser.add_mutually_exclusive_group()
attn_group.add_argument("--attention-split", action="store_true")
attn_group.add_argument("--attention-pytorch", action="store_true")

upcast = parser.add_mutually_exclusive_group()
upcast.add_argument("--force-upcast-attention", action="store_true")
upcast.add_argument("--disable-attention-upcast", action="store_true")

parser.add_argument("--xformers", action="store_true", help="install xformers for cross attention")
parser.add_argument("--sage", action="store_true", help="install sageattention")
parser.add_argument("--flash", action="store_true", help="install flash_attn")
parser.add_argument("--disable-xformers", action="store_true")
parser.add_argument("--disable-sage", action="store_true")
parser.add_argument("--disable-flash", action="store_true")

vram_group = parser.add_mutually_exclusive_group()
vram_group.add_argument("--always-gpu", action="store_true")
vram_group.add_argument("--always-cpu", action="store_true")
parser.add_argument("--vae-in-cpu", action="store_true")
parser.add_argument("--pytorch-deterministic", action="store_true")

parser.add_argument("--sage2-function", type=SageAttentionFuncs, default=SageAttentionFuncs.auto, action=EnumAction)
parser.add_argument("--sage-quantization-backend", type=Sage_quantization_backend,
                    default=Sage_quantization_backend.triton, action=EnumAction)
parser.add_argument("--sage-quant-gran", type=Sage_qk_quant_gran, default=Sage_qk_quant_gran.per_thread,
                    action=EnumAction)
parser.add_argument("--sage-accum-dtype", type=Sage_pv_accum_dtype, default=Sage_pv_accum_dtype.fp32,
                    action=EnumAction)

#: Parsed once, at import: flags an extension adds later (preload.py) never show up here.
args = parser.parse_known_args(sys.argv[1:])[0]

dynamic_args = dict(embedding_dir="./embeddings", emphasis_name="original", num_tokens={"c": 0, "uc": 0})
