"""Sparse attention engaged in a diffusers run: a small random-weight Wan 2.1 transformer at 12,288 tokens or
more, sampled with classifier-free guidance as diffusers' WanPipeline samples, through
``lib_attn.integrations.diffusers.route(pipe, sparse=...)``; prints the readout, the float64 error of every
self-attention call's returned output, and the time per step with sparse on and off.

    python tools/sparse_wan.py [--frames 13 --height 768 --width 1024 --steps 6 --layers 3 --heads 2]
                               [--sparse "block-sparse"] [--gain 3] [--rows 1024] [--rounds 3] [--no-dense]

(docs/sparse.md's numbers: ``--steps 10``; the last call's timing: ``--steps 1 --rounds 5 --no-dense``.)

**Local attention, honestly made.** Wan's self-attention computes ``q = norm_q(to_q(x))``, ``k = norm_k(to_k(x))``
(an RMS norm over all heads), then rotates both by the token's place on the latent (frame, row, column) grid
(RoPE). Here ``to_q`` and ``to_k`` have zero weights and one shared random bias per layer, so before RoPE
every token's q and k are the same vector c (per head), scaled by the norm's weight (``--gain``); after
it, the score of query i and key j is ``c · R(p_j - p_i) c / sqrt(d)``, a function of the two tokens'
relative place only, largest at the same place: attention to neighbours in space and time, as RoPE gives
a video model. The values, the feed-forward layers and everything else are random. ``--gain`` sets how
sharp that is (the score at the same place is ``gain**2 * d / sqrt(d)``); at 3 the calls' error against
float64 at top-k 0.2 of 128-token blocks is 0.01-0.08 (by layer), at 2 about 0.26 (over the default budget).

**The run.** WanPipeline with prompt embeddings given (random, 16 tokens) and latents out, so no text
encoder or VAE runs; it needs ``transformers`` (WanPipeline's module imports it). Without it, ``WanLoop``
runs the same denoising loop (diffusers 0.39's ``pipeline_wan.py``: per step the cond then the uncond model
call, each under the transformer's ``cache_context``, the scheduler's ``set_begin_index(0)`` and ``step``).
The scheduler is Wan 2.1's (UniPC, flow prediction, flow shift 3). Tokens: (frames - 1) / 4 + 1 latent
frames × (height / 16) × (width / 16); 13 × 768 × 1024 is 4 × 48 × 64 = 12,288.

**float64.** Every self-attention call's q, k and v (made again from the attention module's input, as Wan's
processor makes them) and its returned output (what reaches the module's output projection) are read by
hooks on the module, outside the route, and the output's relative L2 error against float64 attention is
computed on ``--rows`` random query rows of every head (its time is left out of the step times).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch

import lib_attn
from lib_attn import readout
from lib_attn.integrations.diffusers import route

#: The text embeddings' width and tokens (random; no text encoder runs).
TEXT_DIM, TEXT_TOKENS = 32, 16


def local_wan(layers: int = 3, heads: int = 2, head_dim: int = 64, gain: float = 3.0, seed: int = 0):
    """A random-weight ``WanTransformer3DModel`` (Wan 2.1's patch (1, 2, 2), 16 latent channels) whose
    self-attention scores depend on the tokens' relative place only (the module's docstring)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                  in_channels=16, out_channels=16, text_dim=TEXT_DIM, freq_dim=32,
                                  ffn_dim=2 * heads * head_dim, num_layers=layers).eval()
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn1
            c = torch.randn(attn.to_q.out_features)
            for proj, norm in ((attn.to_q, attn.norm_q), (attn.to_k, attn.norm_k)):
                proj.weight.zero_()
                proj.bias.copy_(c)
                norm.weight.fill_(gain)
    return model


def wan_scheduler():
    """Wan 2.1's scheduler (its diffusers release: UniPC, flow prediction, flow sigmas, shift 3)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                   num_train_timesteps=1000)


def _loop_class():
    from diffusers import DiffusionPipeline

    class WanLoop(DiffusionPipeline):
        """WanPipeline's denoising loop (diffusers 0.39) with prompt embeddings given and latents out."""

        def __init__(self, transformer, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, prompt_embeds, negative_prompt_embeds, latents, num_inference_steps: int,
                     guidance_scale: float = 5.0, callback_on_step_end=None, output_type: str = "latent"):
            self.scheduler.set_timesteps(num_inference_steps, device=latents.device)
            self.scheduler.set_begin_index(0)
            model = self.transformer
            for i, t in enumerate(self.scheduler.timesteps):
                timestep = t.expand(latents.shape[0])
                with model.cache_context("cond"):
                    cond = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=prompt_embeds,
                                 return_dict=False)[0]
                with model.cache_context("uncond"):
                    uncond = model(hidden_states=latents, timestep=timestep,
                                   encoder_hidden_states=negative_prompt_embeds, return_dict=False)[0]
                latents = self.scheduler.step(uncond + guidance_scale * (cond - uncond), t, latents,
                                              return_dict=False)[0]
                if callback_on_step_end is not None:
                    callback_on_step_end(self, i, t, {})
            return (latents,)

    return WanLoop


def pipeline(model, real: bool | None = None):
    """WanPipeline over ``model`` (no text encoder, tokenizer or VAE), or ``WanLoop`` where ``transformers``
    is missing (``real`` None) or ``real`` is False."""
    if real is not False:
        try:
            from diffusers.pipelines.wan.pipeline_wan import WanPipeline
        except ImportError:
            if real:
                raise
        else:
            return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=wan_scheduler(),
                               transformer=model)
    return _loop_class()(model, wan_scheduler())


def latent_grid(frames: int, height: int, width: int) -> tuple:
    return ((frames - 1) // 4 + 1, height // 8, width // 8)


def sample(pipe, frames: int, height: int, width: int, steps: int, seed: int = 0, on_step=None):
    """One run of ``pipe`` as WanPipeline is called (guidance 5); returns the latents."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g)
    negative = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g)
    latents = torch.randn(1, 16, *latent_grid(frames, height, width), generator=g)
    kwargs = dict(prompt_embeds=embeds, negative_prompt_embeds=negative, latents=latents, num_inference_steps=steps,
                  guidance_scale=5.0, output_type="latent", callback_on_step_end=on_step)
    if type(pipe).__name__ == "WanPipeline":
        kwargs.update(height=height, width=width, num_frames=frames)
        kwargs["callback_on_step_end"] = _pipeline_callback(on_step)
    return pipe(**kwargs)[0]


def _pipeline_callback(on_step):
    if on_step is None:
        return None

    def callback(pipe, i, t, tensors):
        on_step(pipe, i, t, tensors)
        return {}

    return callback


def float64_error(q, k, v, out, rows: int, gen) -> float:
    """The relative L2 error of ``out`` against float64 attention on ``rows`` random query rows of every
    (batch, head), q, k, v and out as diffusers' dispatcher takes them: (batch, tokens, heads, head dim)."""
    n, d = q.shape[1], q.shape[-1]
    pick = torch.randperm(n, generator=gen)[:rows]
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q[:, pick], k, v))
    ref = torch.softmax(qd @ kd.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vd
    got = out[:, pick].transpose(1, 2).double()
    return float((got - ref).norm() / ref.norm())


def _rotated(x, cos, sin):
    """Wan's rotary embedding as its attention processor applies it (pairs of adjacent channels)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class Calls:
    """Each self-attention call of ``model`` in a run: (model call, block, float64 error of its returned
    output on ``rows`` rows). Hooks on each block's ``attn1``, outside the route: q, k, v are made from the
    module's input as Wan's processor makes them (projections, RMS norms, heads, RoPE), and the output is
    what reaches the module's output projection (``to_out[0]``'s input)."""

    def __init__(self, model, rows: int = 1024, seed: int = 0):
        self.model, self.rows = model, rows
        self.gen = torch.Generator().manual_seed(seed)
        self.found: list = []  # (model call, block, error)
        self.seconds = 0.0  # spent in the hooks (q, k, v made again; float64), left out of the step times
        self.model_calls = -1
        self._qkv = None
        self.last = None  # the last call's (q, k, v), (batch, tokens, heads, head dim)

    @contextlib.contextmanager
    def watching(self):
        def model_call(module, args, kwargs):
            self.model_calls += 1

        def inputs(attn, args, kwargs):
            started = time.perf_counter()
            hidden, rotary = args[0], kwargs.get("rotary_emb", args[3] if len(args) > 3 else None)
            q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (
                attn.norm_q(attn.to_q(hidden)), attn.norm_k(attn.to_k(hidden)), attn.to_v(hidden)))
            self._qkv = (_rotated(q, *rotary), _rotated(k, *rotary), v)
            self.seconds += time.perf_counter() - started

        def output(i):
            def hook(proj, args):
                started = time.perf_counter()
                q, k, v = self._qkv
                out = args[0].unflatten(2, (q.shape[2], -1))
                self.found.append((self.model_calls, i, float64_error(q, k, v, out, self.rows, self.gen)))
                self.last, self._qkv = self._qkv, None
                self.seconds += time.perf_counter() - started
            return hook

        hooks = [self.model.register_forward_pre_hook(model_call, with_kwargs=True)]
        if self.rows:
            for i, block in enumerate(self.model.blocks):
                hooks.append(block.attn1.register_forward_pre_hook(inputs, with_kwargs=True))
                hooks.append(block.attn1.to_out[0].register_forward_pre_hook(output(i)))
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()


def kind_of(model_call: int, block: int, steps: int, bands: int = 5) -> str:
    """The readout's kind of a call of WanPipeline's run (two model calls per step: cond, then uncond)."""
    step, second = divmod(model_call, 2)
    band = min(step * bands // steps, bands - 1)
    label = f"block {block}, {band * 100 // bands}-{(band + 1) * 100 // bands}%"
    return label + (", call 2 of the step" if second else "")


def run(args, sparse) -> dict:
    model = local_wan(args.layers, args.heads, args.head_dim, args.gain)
    pipe = pipeline(model)
    calls = Calls(model, args.rows)
    marks = [time.perf_counter()]

    def on_step(pipe, i, t, tensors):
        marks.append(time.perf_counter() - calls.seconds)  # every measurement so far left out

    with torch.no_grad(), route(pipe, sparse=sparse), lib_attn.recording() as rec, calls.watching():
        sample(pipe, args.frames, args.height, args.width, args.steps, on_step=on_step)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    f, h, w = latent_grid(args.frames, args.height, args.width)
    return {"pipeline": type(pipe).__name__, "tokens": f * (h // 2) * (w // 2), "steps": steps,
            "report": lib_attn.Report.from_recording(rec), "calls": calls.found, "last": calls.last}


def call_times(q, k, v, sparse: str, rounds: int) -> tuple:
    """Median seconds of one self-attention call (q, k, v of the run's last call), PyTorch's SDPA against
    the engine with ``sparse`` on (its first call, which calibrates, left out), interleaved ``rounds`` times;
    and the engine's readout of those calls."""
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    dense, engine = [], []

    def served(q, k, v):
        return lib_attn.attention(q, k, v, role="dit")

    with torch.no_grad(), lib_attn.use(sparse=sparse), lib_attn.recording() as rec:
        served(q, k, v)
        for _ in range(rounds):
            for times, fn in ((dense, F.scaled_dot_product_attention), (engine, served)):
                started = time.perf_counter()
                fn(q, k, v)
                times.append(time.perf_counter() - started)
    return statistics.median(dense), statistics.median(engine), lib_attn.Report.from_recording(rec)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=13)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--gain", type=float, default=3.0)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--sparse", default="block-sparse")
    parser.add_argument("--no-dense", action="store_true", help="skip the run with sparse off")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds timing the last call alone")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    f, h, w = latent_grid(args.frames, args.height, args.width)
    print(f"tokens {f * (h // 2) * (w // 2):,} ({f} × {h // 2} × {w // 2}); {args.layers} layers, {args.heads} heads "
          f"of {args.head_dim}; {args.steps} steps; sparse {args.sparse!r}", flush=True)
    result = run(args, args.sparse)
    print(f"pipeline {result['pipeline']}")
    print(readout.text(result["report"]))
    sparse = result["report"].sparse
    print("\nfloat64 error of each self-attention call's returned output "
          f"({args.rows} random rows per head), by the readout's kind:")
    by_kind: dict = {}
    for model_call, block, error in result["calls"]:
        by_kind.setdefault(kind_of(model_call, block, args.steps), []).append(error)
    for (role, backend, kind, setting), n in (sparse.kind_items() if sparse else []):
        mine = by_kind.pop(kind, [])
        print(f"  {kind} at {setting} ×{n}: readout error max {sparse.error_max((role, backend, kind, setting)):.4f}; "
              f"float64 {', '.join(f'{e:.4f}' for e in mine)}")
    dense = [e for errors in by_kind.values() for e in errors]
    if dense:
        print(f"  the {len(dense)} other self-attention calls (dense): float64 error max {max(dense):.1e}")
    times = result["steps"]
    print(f"\nseconds per step, sparse on: {' '.join(f'{s:.1f}' for s in times)} "
          f"(median {statistics.median(times):.1f})")
    if args.rounds and result["last"] is not None:
        dense, engine, report = call_times(*result["last"], args.sparse, args.rounds)
        print(f"the run's last self-attention call alone, median of {args.rounds} interleaved: SDPA {dense:.2f} s, "
              f"engine with sparse on {engine:.2f} s ({dense / engine:.2f}x)")
        print("  " + "\n  ".join(readout.sparse_lines(report)))
    if not args.no_dense:
        lib_attn.reset()
        args.rows = 0
        off = run(args, "off")["steps"]
        print(f"seconds per step, sparse off: {' '.join(f'{s:.1f}' for s in off)} "
              f"(median {statistics.median(off):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
