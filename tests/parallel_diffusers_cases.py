"""One rank of the multi-process check of ``route(model, parallel=...)`` on tiny random-weight
diffusers models (started by tests/test_parallel_diffusers.py, as torchrun would): every rank builds
the same models and inputs from one seed, runs each model once routed on one process (the
reference) and once split over the ranks, and reports the relative difference and its readout.

    python tests/parallel_diffusers_cases.py SEED
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lib_attn  # noqa: E402
from lib_attn import parallel  # noqa: E402
from lib_attn.integrations.diffusers import route  # noqa: E402
from lib_attn.parallel import launch  # noqa: E402


def _flux(gen):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=3, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()
    side_h, side_w, text = 5, 7, 6  # 35 image tokens: not a multiple of 2 ranks; 3 heads: not of ulysses 2
    ids = torch.stack(torch.meshgrid(torch.arange(side_h), torch.arange(side_w), indexing="ij"), -1).reshape(-1, 2)
    inputs = dict(hidden_states=torch.randn(1, side_h * side_w, 4, generator=gen),
                  encoder_hidden_states=torch.randn(1, text, 32, generator=gen),
                  pooled_projections=torch.randn(1, 32, generator=gen), timestep=torch.tensor([0.5]),
                  img_ids=torch.cat([torch.zeros(side_h * side_w, 1), ids.float()], dim=1),
                  txt_ids=torch.zeros(text, 3), return_dict=False)
    return model, inputs


def _wan(gen):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                  rope_max_seq_len=32).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 6, 10, generator=gen), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, 32, generator=gen), return_dict=False)
    return model, inputs  # 3 x 3 x 5 = 45 video tokens


def _unet(gen):
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                 block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                 attention_head_dim=8, norm_num_groups=32).eval()
    inputs = dict(sample=torch.randn(1, 4, 9, 7, generator=gen), timestep=torch.tensor([10]),
                  encoder_hidden_states=torch.randn(1, 5, 32, generator=gen), return_dict=False)
    return model, inputs


def main(seed: int):
    rank, world, _ = launch.init(timeout=120)
    out = {"rank": rank, "models": {}}
    for name, build in (("flux", _flux), ("wan", _wan), ("unet", _unet)):
        torch.manual_seed(seed)  # the same weights on every rank
        gen = torch.Generator().manual_seed(seed)
        model, inputs = build(gen)
        for key, value in list(inputs.items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                inputs[key] = value.double()
        model = model.double()
        with torch.no_grad():
            with route(model), lib_attn.recording() as one:
                want = model(**inputs)[0]
            rows = {}
            for u, r in ((world, 1), (1, world)):
                par = parallel.Parallel(ulysses=u, ring=r, timeout=60)
                with route(model, parallel=par), lib_attn.recording() as rec:
                    got = model(**inputs)[0]
                err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
                rows[f"{u}x{r}"] = {"err": err, "shape_ok": got.shape == want.shape,
                                    "parallel": [[*key, n, sent] for key, (n, sent) in rec.parallel.items()],
                                    "calls": sum(rec.calls.values())}
        out["models"][name] = {"one_process_calls": sum(one.calls.values()), "rows": rows}
    try:
        with route(torch.nn.Linear(2, 2), role="dit", parallel=parallel.Parallel(timeout=60)):
            pass
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    out["processors"] = _processors(seed, world)
    out["refusals"] = _refusals(seed)
    out["inside"] = _inside(seed, world)
    out["fault"] = _fault(seed)  # last: it leaves the group broken
    launch.report(out)
    sys.stdout.flush()
    os._exit(0)  # no barrier over a broken group


def _processors(seed: int, world: int) -> dict:
    """A UNet with diffusers' matmul processors (AttnProcessor, and SlicedAttnProcessor as
    enable_attention_slicing sets it) split over the ranks, against the same model on one process."""
    from diffusers.models.attention_processor import AttnProcessor

    rows = {}
    for name, setup in (("AttnProcessor", lambda m: m.set_attn_processor(AttnProcessor())),
                        ("SlicedAttnProcessor", lambda m: m.set_attention_slice(1))):
        torch.manual_seed(seed)
        model, inputs = _unet(torch.Generator().manual_seed(seed))
        model = model.double()
        inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in inputs.items()}
        setup(model)
        held = sorted({type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")})
        with torch.no_grad():
            want = model(**inputs)[0]  # one process, the processor's own code
            for u, r in ((world, 1), (1, world)):
                with route(model, parallel=parallel.Parallel(ulysses=u, ring=r, timeout=60)), \
                        lib_attn.recording() as rec:
                    got = model(**inputs)[0]
                err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
                rows[f"{name} {u}x{r}"] = {"err": err, "held": held, "split": sum(n for n, _ in rec.parallel.values()),
                                           "after": sorted({type(m.processor).__name__ for m in model.modules()
                                                            if hasattr(m, "processor")})}
    return rows


class _OwnProcessor:
    """A processor of a user's own, attending with plain matmuls."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        weights = torch.softmax(q @ k.transpose(-1, -2) * attn.scale, dim=-1)
        return attn.to_out[1](attn.to_out[0](weights @ v))


def _refusals(seed: int) -> dict:
    """What route(parallel=) refuses, and that it refuses before the model runs: a processor it
    cannot split (xformers', a user's own), First Block Cache, Flux's IP-Adapter processor."""
    from diffusers.hooks import FirstBlockCacheConfig, LayerSkipConfig, apply_first_block_cache, apply_layer_skip
    from diffusers.models.attention_processor import XFormersAttnProcessor
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    out = {}
    cases = {
        "xformers": (_unet, lambda m: m.set_attn_processor(XFormersAttnProcessor())),
        "own": (_unet, lambda m: m.down_blocks[0].attentions[0].transformer_blocks[0].attn1.set_processor(
            _OwnProcessor())),
        "first block cache": (_flux, lambda m: apply_first_block_cache(m, FirstBlockCacheConfig(threshold=0.05))),
        "layer skip": (_unet, lambda m: apply_layer_skip(m, LayerSkipConfig(
            indices=[0], fqn="down_blocks.0.attentions.0.transformer_blocks", skip_attention=False,
            skip_attention_scores=True, skip_ff=False))),
        "ip-adapter": (_flux, lambda m: m.transformer_blocks[0].attn.set_processor(
            FluxIPAdapterAttnProcessor(48, 32, num_tokens=(4,)))),
    }
    for name, (build, setup) in cases.items():
        model, inputs = build(torch.Generator().manual_seed(seed))
        setup(model)
        calls = []
        hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            with route(model, parallel=parallel.Parallel(timeout=60)):
                model(**inputs)
            out[name] = {"error": "", "ran": len(calls)}
        except ValueError as exc:
            out[name] = {"error": str(exc), "ran": len(calls)}
        hook.remove()
    out["ip masks"] = _ip_masks(seed)
    return out


def _double(build, seed: int, batch: int = 1):
    torch.manual_seed(seed)
    model, inputs = build(torch.Generator().manual_seed(seed))
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    if batch == 2:  # PAG's processors take (conditional, perturbed) halves
        inputs["sample"] = torch.cat([inputs["sample"], inputs["sample"] * 0.5])
        inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].repeat(2, 1, 1)
    return model.double(), inputs


def _inside(seed: int, world: int) -> dict:
    """Processors and hooks set after route(parallel=) opened, as users and pipelines do: each either
    gives the one-process output of the same setup or is refused on every rank before any exchange."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.smoothed_energy_guidance_utils import (SmoothedEnergyGuidanceConfig,
                                                                _apply_smoothed_energy_guidance_hook)
    from diffusers.models.attention_processor import AttnProcessor, XFormersAttnProcessor
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
    from diffusers.pipelines.pag.pag_utils import PAGMixin

    class Pag(PAGMixin):  # what StableDiffusionPAGPipeline.__call__ does with its UNet
        def __init__(self, unet):
            self.unet = unet
            self.set_pag_applied_layers(["down"])

        def __call__(self, model):
            self._set_pag_attn_processor(pag_applied_layers=self.pag_applied_layers,
                                         do_classifier_free_guidance=False)

    seg = SmoothedEnergyGuidanceConfig(indices=[0], fqn="down_blocks.0.attentions.0.transformer_blocks")
    first = "down_blocks.0.attentions.0.transformer_blocks.0"
    cases = {  # name: (build, batch, setup(model))
        "AttnProcessor": (_unet, 1, lambda m: m.set_attn_processor(AttnProcessor())),
        "slicing": (_unet, 1, lambda m: m.set_attention_slice(1)),
        "PAG": (_unet, 2, lambda m: Pag(m)(m)),
        "own cross": (_unet, 1, lambda m: m.get_submodule(first + ".attn2").set_processor(_OwnProcessor())),
        "own self": (_unet, 1, lambda m: m.get_submodule(first + ".attn1").set_processor(_OwnProcessor())),
        "xformers": (_unet, 1, lambda m: m.set_attn_processor(XFormersAttnProcessor())),
        "SEG": (_unet, 1, lambda m: _apply_smoothed_energy_guidance_hook(m, seg, 1.0, name="seg")),
        "first block cache": (_flux, 1, lambda m: apply_first_block_cache(m, FirstBlockCacheConfig(threshold=0.05))),
        "flux ip-adapter": (_flux, 1, lambda m: m.transformer_blocks[0].attn.set_processor(
            FluxIPAdapterAttnProcessor(48, 32, num_tokens=(4,)).double())),
    }
    out = {}
    for name, (build, batch, setup) in cases.items():
        row = {"error": "", "err": None, "blocks_ran": 0}
        with torch.no_grad():
            if name not in ("xformers", "SEG", "first block cache", "flux ip-adapter"):
                model, inputs = _double(build, seed, batch)
                setup(model)
                want = model(**inputs)[0]
            model, inputs = _double(build, seed, batch)
            blocks = [m for m in model.modules() if type(m).__name__ in ("BasicTransformerBlock",
                                                                         "FluxTransformerBlock")]
            counts = [b.register_forward_pre_hook(lambda *a: row.__setitem__("blocks_ran", row["blocks_ran"] + 1))
                      for b in blocks]
            try:
                with route(model, parallel=parallel.Parallel(ring=world, timeout=20)), lib_attn.recording() as rec:
                    setup(model)
                    got = model(**inputs)[0]
                row["err"] = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
                row["split"] = sum(n for n, _ in rec.parallel.values())
            except Exception as exc:  # noqa: BLE001 - a stall's ParallelError is a finding too
                row["error"] = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            for c in counts:
                c.remove()
        row["after"] = sorted({type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")
                               and "_lib_attn_role" in type(m.processor).__dict__})
        out[name] = row
    return out


def _ip_masks(seed: int) -> str:
    """A UNet's IP-Adapter processors on its cross-attention are split (both calls are cross calls), but
    IP-Adapter masks would be scaled to a rank's share as if it were the whole image: refused."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    model, _ = _unet(torch.Generator().manual_seed(seed))
    attn2 = model.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    attn2.set_processor(IPAdapterAttnProcessor2_0(attn2.inner_dim, 32, num_tokens=(4,)))
    hidden = torch.randn(1, 16, attn2.inner_dim)
    context = (torch.randn(1, 5, 32), [torch.randn(1, 1, 4, 32)])
    try:
        with torch.no_grad(), route(model, parallel=parallel.Parallel(timeout=60)):
            attn2(hidden, encoder_hidden_states=context, ip_adapter_masks=[torch.ones(1, 1, 4, 4)])
        return ""
    except ValueError as exc:
        return str(exc)


def _fault(seed: int) -> dict:
    """Rank 1 raises inside the denoiser's second block during a split run: every rank must end with a
    clear error within the timeout (rank 0 waits on rank 1 in the next exchange)."""
    import time

    torch.manual_seed(seed)
    model, inputs = _wan(torch.Generator().manual_seed(seed))
    if torch.distributed.get_rank() == 1:
        def fail(*args):
            raise RuntimeError("injected failure on rank 1")
        model.blocks[1].register_forward_pre_hook(fail)
    start = time.monotonic()
    try:
        with torch.no_grad(), route(model, parallel=parallel.Parallel(ring=2, timeout=3)):
            model(**inputs)
        error = ""
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank saw
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


if __name__ == "__main__":
    main(int(sys.argv[1]))
