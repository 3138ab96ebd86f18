"""Command line: ``python -m lib_attn doctor [--json]``, ``python -m lib_attn bench ...`` and
``python -m lib_attn tune ...``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

MODEL_CHOICES = ("sd15", "sd2", "sdxl", "sd3", "flux", "vae", "all")


def _split(values: Optional[List[str]]) -> Optional[List[str]]:
    """Accept both ``--backends a b`` and ``--backends a,b``."""
    if not values:
        return None
    return [v for item in values for v in item.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lib_attn",
                                     description="Attention engine diagnostics and benchmark.")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,bench,tune}")

    doc = sub.add_parser("doctor", help="versions, device, backends and what the engine would run")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument("--dtype", help="dtype of the described calls (default: fp32 on CPU, "
                                     "fp16 UNet/VAE and bf16 DiT on a GPU)")

    b = sub.add_parser("bench", help="time every backend on real model attention calls")
    b.add_argument("--model", default=None, choices=MODEL_CHOICES,
                   help="model whose calls to time (default: sd15 on CPU, all on a GPU)")
    b.add_argument("--res", type=int, default=None,
                   help="image side in pixels (default: each model's native size)")
    b.add_argument("--dtype", nargs="+", default=None,
                   help="fp16, bf16 and/or fp32 (default: fp32 on CPU; fp16 UNet/VAE and "
                        "bf16 DiT on a GPU)")
    b.add_argument("--backends", nargs="+", default=None,
                   help="columns to time: auto and/or backend ids (default: auto + every "
                        "available backend)")
    b.add_argument("--json", dest="json_path", metavar="FILE", help="write all results as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="bar chart of ms per step (needs matplotlib)")
    b.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    b.add_argument("--budget", type=float, default=None,
                   help="timed seconds per call row across all columns (default 1.5 CPU, 0.4 GPU)")
    b.add_argument("--no-overhead", action="store_true", help="skip the engine overhead measurement")
    b.add_argument("--overhead-rounds", type=int, default=200, help=argparse.SUPPRESS)
    b.add_argument("--no-memory", action="store_true", help="skip the peak memory measurement")
    b.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    b.add_argument("--tune", choices=("on", "off"), default="on",
                   help="the auto column with tuning on (default: it runs what tuning ranks fastest) or off "
                        "(the fixed order)")

    t = sub.add_parser("tune", help="measure each call kind's backends and store the fastest correct one")
    t.add_argument("--model", default=None, choices=MODEL_CHOICES,
                   help="model whose calls to tune (default: sd15 on CPU, all on a GPU)")
    t.add_argument("--res", type=int, default=None, help="image side in pixels (default: each model's native size)")
    t.add_argument("--dtype", nargs="+", default=None,
                   help="fp16, bf16 and/or fp32 (default: fp32 on CPU; fp16 UNet/VAE and bf16 DiT on a GPU)")
    t.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    t.add_argument("--clear", action="store_true",
                   help="forget every stored result first (alone: only forget)")
    return parser


def _bench(args, parser: argparse.ArgumentParser) -> int:
    import torch

    from lib_attn import bench, shapes

    if args.plot:
        missing = bench.matplotlib_missing()
        if missing:
            parser.error(missing)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    model = args.model or ("all" if torch.device(device).type == "cuda" else "sd15")
    models = list(shapes.MODELS) if model == "all" else [model]
    try:
        dtypes = [bench.dtype_name(bench.parse_dtype(d)) for d in _split(args.dtype) or []] or None
        settings = bench.BenchSettings(models=models, res=args.res, dtypes=dtypes,
                                       backends=_split(args.backends), device=device,
                                       budget_s=args.budget, overhead=not args.no_overhead,
                                       overhead_rounds=args.overhead_rounds,
                                       memory=not args.no_memory, progress=not args.no_progress,
                                       tune=args.tune)
        bench.resolve_columns(settings.backends)
        for m in models:
            shapes.model_calls(m, args.res)
    except ValueError as exc:
        parser.error(str(exc))
    doc = bench.run(settings)
    print(bench.render(doc))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nJSON written to {args.json_path}")
    if args.plot:
        bench.plot(doc, args.plot)
        print(f"chart written to {args.plot}")
    return 0


def _tune(args, parser: argparse.ArgumentParser) -> int:
    import torch

    from lib_attn import pretune, shapes, tune

    if args.clear:
        removed = tune.clear()
        print(f"{'removed' if removed else 'no stored results at'} {tune.cache_path()}")
        if args.model is None and args.res is None and args.dtype is None:
            return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    model = args.model or ("all" if torch.device(device).type == "cuda" else "sd15")
    models = list(shapes.MODELS) if model == "all" else [model]
    try:
        from lib_attn.bench import parse_dtype

        dtypes = [parse_dtype(d) for d in _split(args.dtype) or []] or None
        for m in models:
            shapes.model_calls(m, args.res)
    except ValueError as exc:
        parser.error(str(exc))
    rows = pretune.run(models, args.res, dtypes, torch.device(device))
    print(pretune.render(rows, torch.device(device)))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from lib_attn import doctor

        dtype = None
        if args.dtype:
            from lib_attn.bench import parse_dtype

            try:
                dtype = parse_dtype(args.dtype)
            except ValueError as exc:
                parser.error(str(exc))
        if args.json:
            return doctor.main(as_json=True, dtype=dtype)
        return doctor.main(dtype=dtype)
    if args.command == "bench":
        return _bench(args, parser)
    if args.command == "tune":
        return _tune(args, parser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
