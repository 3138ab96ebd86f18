"""block-sparse's error against float64 on a joint call, with and without its text tokens told.

    python tools/joint_text_error.py [--grid 12x32x32] [--text 256,512] [--topk 0.1,0.15,0.2,0.3] [--word 3.3]

The inputs are a joint call as an MMDiT's (Flux, SD3) or HunyuanVideo's: image tokens on a (frames, height,
width) grid whose q and k hold only a rotary position term (``rope_inputs``: local attention), and a text
of ``--text`` tokens at the front whose keys are distinct directions (one per word, of large norm). Each
image query also carries the direction of one word, the same for a patch of the grid (a region of the
image follows a word of the prompt), so image queries attend strongly to a few text tokens, which
differ from region to region: a text block's mean key cancels the words out and its pooled score stays
low. The text's queries mix the words and the image's positions.

For each top-k it runs ``block-sparse`` (its gather design, fp32) on the call as a bare one and inside
``lib_attn.conditioning.text`` (the text's key blocks kept by every query block, its query rows exact),
and prints the share of (query block, key block) pairs computed and the relative L2 error against
float64 attention on 1,024 rows drawn evenly over the sequence (``sparse_measure.draw``), the image rows'
and the text rows' apart.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/tools/", 1)[0])

from lib_attn import conditioning  # noqa: E402
from lib_attn import sparse_measure as measure  # noqa: E402
from lib_attn.commands.bench.inputs import grid_coords, rope_inputs  # noqa: E402
from lib_attn.kernels import REGISTRY  # noqa: E402
from lib_attn.kernels.sparse import Knob  # noqa: E402


def joint_inputs(grid, text: int, heads: int, head_dim: int, seed: int = 0, word: float = 3.3, patch: int = 8):
    """(q, k, v) float64 (1, heads, text + image, head_dim), the text first (see the module); ``word``: the
    score of an image query's word, about ``word`` squared (3.3: a quarter of an image query's attention on
    the text, 3.5: half)."""
    gen = torch.Generator().manual_seed(seed)
    qi, ki, vi = (t.double() for t in rope_inputs(1, heads, grid, head_dim, torch.float64, torch.device("cpu"),
                                                   seed=seed, strength=0.5))
    n, coords = grid_coords(grid)
    words = torch.nn.functional.normalize(torch.randn(heads, text, head_dim, generator=gen, dtype=torch.float64), dim=-1)
    # the word each image patch follows: patches of ``patch`` × ``patch`` positions, every frame alike
    cells = (coords[:, 1] // patch) * (grid[2] // patch + 1) + coords[:, 2] // patch
    chosen = torch.randperm(text, generator=gen)[cells.long() % text]
    scale = head_dim ** 0.25
    qi = qi + word * scale * words[:, chosen][None]
    kt = (word * scale * words + 0.3 * torch.randn(heads, text, head_dim, generator=gen, dtype=torch.float64))[None]
    qt = (words.flip(1) * scale + torch.randn(heads, text, head_dim, generator=gen, dtype=torch.float64))[None]
    vt = torch.randn(1, heads, text, head_dim, generator=gen, dtype=torch.float64)
    return (torch.cat([qt, qi], 2), torch.cat([kt, ki], 2), torch.cat([vt, vi], 2))


def text_mass(q, k, text: int, samples) -> float:
    """The mean share of an image query's attention on the text tokens (float64), on the sampled rows."""
    masses = []
    for b, h, rows in zip(samples.batch.tolist(), samples.head.tolist(), samples.rows):
        rows = rows[rows >= text]
        p = torch.softmax((q[b, h, rows] @ k[b, h].T) * q.shape[-1] ** -0.5, -1)
        masses.append(p[:, :text].sum(-1))
    return float(torch.cat(masses).mean())


def errors(out, q, k, v, samples, text: int):
    """(all rows, image rows, text rows) relative L2 error of ``out`` against float64 attention."""
    sums = torch.zeros(3, 2, dtype=torch.float64)
    for b, h, rows in zip(samples.batch.tolist(), samples.head.tolist(), samples.rows):
        exact = torch.softmax((q[b, h, rows] @ k[b, h].T) * q.shape[-1] ** -0.5, -1) @ v[b, h]
        diff, norm = (out[b, h, rows].double() - exact).square().sum(-1), exact.square().sum(-1)
        for i, keep in enumerate((rows >= 0, rows >= text, rows < text)):
            sums[i] += torch.stack([diff[keep].sum(), norm[keep].sum()])
    return tuple(float((d / n).sqrt()) if n else float("nan") for d, n in sums)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="12x32x32")
    parser.add_argument("--text", default="256,512")
    parser.add_argument("--topk", default="0.1,0.15,0.2,0.3")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--word", type=float, default=3.3, help="the strength of an image query's word (3.3: a "
                        "quarter of its attention on the text, 3.5: half)")
    args = parser.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split("x"))
    backend = REGISTRY["block-sparse"]
    backend.forced = "gather"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; block-sparse (gather design, fp32, "
          f"128-token blocks), error against float64 on 1,024 rows drawn evenly")
    for text in (int(x) for x in args.text.split(",")):
        q, k, v = joint_inputs(grid, text, args.heads, args.head_dim, word=args.word)
        n = q.shape[2]
        samples = measure.draw(q, "bhsd", random.Random(1))
        qf, kf, vf = (t.float() for t in (q, k, v))
        print(f"\n{n - text} image tokens on {args.grid} + {text} text tokens first, {args.heads} heads, head dim "
              f"{args.head_dim}: an image query's attention on the text {text_mass(q, k, text, samples):.0%} on average")
        print("top-k | text not told: kept, error (image rows / text rows) | text told: kept, error (image / text)")
        for topk in (float(x) for x in args.topk.split(",")):
            cells = []
            for told in (False, True):
                started = time.perf_counter()
                with conditioning.text(text, total=n) if told else _nothing():
                    result = backend.run_sparse(qf, kf, vf, None, Knob("topk", topk))
                whole, image, words = errors(result.out, q, k, v, samples, text)
                cells.append(f"{float(result.kept):.1%}, {whole:.3f} ({image:.3f} / {words:.3f}) "
                             f"[{time.perf_counter() - started:.1f} s]")
            print(f"{topk:g} | {cells[0]} | {cells[1]}", flush=True)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
