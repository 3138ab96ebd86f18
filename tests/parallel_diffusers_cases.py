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
    launch.report(out)
    launch.finish()


if __name__ == "__main__":
    main(int(sys.argv[1]))
