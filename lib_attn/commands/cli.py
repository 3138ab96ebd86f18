"""The command line, ``python -m lib_attn doctor|bench|tune|parallel``: one parser for the commands,
the options they share (``--model``, ``--res``, ``--dtype``, ``--device``) defined and read in one
place, and one way of writing results: a command module builds a document and its text, and only
this module prints them (``_print``, ``_print_json``, ``_save_json``)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional

import torch

import lib_attn.sparse
from lib_attn import schedule as lib_schedule
from lib_attn import shapes
from lib_attn import tuning_file

from . import bench, doctor
from .bench import sparse as sparse_bench
from . import parallel as parallel_command
from . import tune as tune_command
from .dtypes import dtype_name, parse_dtype

MODEL_CHOICES = (*shapes.MODELS, "all")


# ------------------------------------------------------------------ the parser


def _add_workload(p: argparse.ArgumentParser, verb: str) -> None:
    """``--model``, ``--res`` and ``--dtype``: which calls a command runs ("model whose calls to <verb>")."""
    p.add_argument("--model", default=None, choices=MODEL_CHOICES,
                   help=f"model whose calls to {verb} (default: sd15 on CPU, all on a GPU; all: every image "
                        f"model; the video models {', '.join(shapes.VIDEO_MODELS)} when named)")
    p.add_argument("--res", type=int, default=None,
                   help="image side, or video frame height, in pixels (default: each model's native size; "
                        "wan: 480 and 720)")
    p.add_argument("--dtype", nargs="+", default=None,
                   help="fp16, bf16 and/or fp32 (default: fp32 on CPU; fp16 UNet/VAE and bf16 DiT on a GPU)")


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lib_attn",
                                     description="Attention engine diagnostics and benchmark.")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,bench,tune,parallel}")

    doc = sub.add_parser("doctor", help="versions, device, backends and what the engine would run")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument("--dtype", help="dtype of the described calls (default: fp32 on CPU, "
                                     "fp16 UNet/VAE and bf16 DiT on a GPU)")

    b = sub.add_parser("bench", help="time every backend on real model attention calls")
    _add_workload(b, "time")
    b.add_argument("--backends", nargs="+", default=None,
                   help="columns to time: auto and/or backend ids (default: auto + every "
                        "available backend)")
    b.add_argument("--json", dest="json_path", metavar="FILE", help="write all results as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="bar chart of ms per step; with --sparse, error against the "
                   "share of blocks kept (needs matplotlib)")
    _add_device(b)
    # --seconds, not --budget, so as not to read as sparse attention's error budget; --budget still works.
    b.add_argument("--seconds", "--budget", dest="budget", type=float, default=None, metavar="S",
                   help="timed seconds per call row across all columns (default 1.5 CPU, 0.4 GPU); --budget is "
                        "its older name")
    b.add_argument("--no-overhead", action="store_true", help="skip the engine overhead measurement")
    b.add_argument("--overhead-rounds", type=int, default=200, help=argparse.SUPPRESS)
    b.add_argument("--schedule", default=None, metavar="TEXT",
                   help=f"schedule in force for the overhead measured with a schedule (default: "
                        f"'{bench.SCHEDULE}'; off: not measured)".replace("%", "%%"))  # argparse formats help with %
    b.add_argument("--no-memory", action="store_true", help="skip the peak memory measurement")
    b.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    b.add_argument("--video-scale", type=int, default=None, metavar="N",
                   help="run video calls at 1/N of their video tokens and heads (default: 8 on CPU, 1 on a GPU)")
    b.add_argument("--tune", choices=("on", "off"), default="on",
                   help="the auto column with tuning on (default: it runs what tuning ranks fastest) or off "
                        "(the fixed order)")
    b.add_argument("--sparse", action="store_true",
                   help="dense against sparse attention on the models' long self-attention calls (video models)")
    b.add_argument("--sparse-call", default=None, metavar="BxNxHxD",
                   help="with --sparse: one call of B items, N tokens (a sequence with local attention), H heads, "
                        "head dim D instead of the models' calls")
    b.add_argument("--sparse-grid", default=None, metavar="FxHxW",
                   help="with --sparse-call: lay its N tokens on this (frames, height, width) grid, as a video's "
                        "latents (default: one sequence)")
    b.add_argument("--sparse-topk", type=float, default=0.2, metavar="F",
                   help="with --sparse: the keep fraction of the kernel column (default 0.2)")
    b.add_argument("--sparse-settings", default=None, metavar="TEXT",
                   help="with --sparse: the sparse settings of the engine column (default: "
                        f"'{sparse_bench.DEFAULT_SETTINGS}')")
    b.add_argument("--sparse-rounds", type=int, default=5, metavar="N",
                   help="with --sparse: interleaved timed rounds (default 5)")

    t = sub.add_parser("tune", help="measure each call kind's backends and store the fastest correct one")
    _add_workload(t, "tune")
    _add_device(t)
    t.add_argument("--clear", action="store_true",
                   help="forget every stored result first (alone: only forget)")
    _add_parallel(sub)
    return parser


def _add_parallel(sub) -> None:
    p = sub.add_parser("parallel", help="split model attention calls over N local processes, check and time each mode")
    p.add_argument("--ranks", type=int, default=None,
                   help="processes to start (default: the GPUs this torch sees, at least 2; 2 on CPU)")
    p.add_argument("--model", nargs="+", default=None, choices=shapes.MODELS,
                   help=f"models whose calls to split (default: {' '.join(parallel_command.DEFAULT_MODELS)})")
    p.add_argument("--res", type=int, default=None, help="image side, or video frame height (default: native)")
    p.add_argument("--dtype", default=None, help="fp16, bf16 or fp32 (default: bf16 on GPUs, fp32 on CPU)")
    p.add_argument("--scale", type=int, default=None, metavar="N",
                   help="divide split tokens and heads by N (default: 8 on CPU, 1 on GPUs)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per call and mode (median)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait, and twice that for the whole run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)


# ------------------------------------------------------------------ reading the shared options


def _split(values: Optional[List[str]]) -> Optional[List[str]]:
    """Accept both ``--backends a b`` and ``--backends a,b``."""
    if not values:
        return None
    return [v for item in values for v in item.split(",") if v]


def _dtype(name: str, parser: argparse.ArgumentParser) -> torch.dtype:
    try:
        return parse_dtype(name)
    except ValueError as exc:
        parser.error(str(exc))


def _dtypes(names: Optional[List[str]], parser: argparse.ArgumentParser) -> Optional[List[torch.dtype]]:
    """The dtypes named (``fp16 bf16`` or ``fp16,bf16``); None when none are."""
    return [_dtype(name, parser) for name in _split(names) or []] or None


def _device(requested: Optional[str], parser: argparse.ArgumentParser) -> torch.device:
    """The device asked for, else cuda when this torch sees one, else cpu."""
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    return device


def _models(model: Optional[str], res: Optional[int], device: torch.device,
            parser: argparse.ArgumentParser) -> List[str]:
    """The models whose calls to run (default: every model on a GPU, SD1.5 elsewhere), with
    ``res`` checked against each of them."""
    model = model or ("all" if device.type == "cuda" else "sd15")
    models = list(shapes.IMAGE_MODELS) if model == "all" else [model]
    try:
        for m in models:
            shapes.model_calls(m, res)
    except ValueError as exc:
        parser.error(str(exc))
    return models


# ------------------------------------------------------------------ writing results


def _print(text: str) -> None:
    sys.stdout.write(text + "\n")


def _print_json(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _save_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


# ------------------------------------------------------------------ the commands


def _doctor(args, parser: argparse.ArgumentParser) -> int:
    doc = doctor.report(dtype=_dtype(args.dtype, parser) if args.dtype else None)
    if args.json:
        _print_json(doc)
    else:
        _print(doctor.render(doc))
    return 0


def _sparse_bench(args, parser: argparse.ArgumentParser) -> int:
    device = _device(args.device, parser)
    dtypes = _dtypes(args.dtype, parser) or [torch.float32 if device.type == "cpu" else torch.bfloat16]
    factor = args.video_scale or (8 if device.type == "cpu" else 1)
    if factor < 1:
        parser.error(f"--video-scale {factor}: must be a whole number of 1 or more")
    if not 0 < args.sparse_topk <= 1:
        parser.error(f"--sparse-topk {args.sparse_topk}: must be in (0, 1]")
    settings = args.sparse_settings or sparse_bench.DEFAULT_SETTINGS
    try:
        lib_attn.sparse.parse(settings)
    except ValueError as exc:
        parser.error(f"--sparse-settings: {exc}")
    if args.sparse_call:
        try:
            b, n, h, d = (int(x) for x in args.sparse_call.lower().split("x"))
        except ValueError:
            parser.error(f"--sparse-call {args.sparse_call!r}: write BxNxHxD, e.g. 1x16384x4x128")
        grid = (n,)
        if args.sparse_grid:
            try:
                grid = tuple(int(x) for x in args.sparse_grid.lower().split("x"))
            except ValueError:
                parser.error(f"--sparse-grid {args.sparse_grid!r}: write FxHxW, e.g. 15x32x32")
            if math.prod(grid) != n or min(grid) < 1:
                parser.error(f"--sparse-grid {args.sparse_grid}: holds {math.prod(grid)} tokens, the call {n}")
        calls = [(f"{b}x{n}x{h}x{d}", b, h, d, grid)]
    elif args.sparse_grid:
        parser.error("--sparse-grid needs --sparse-call")
    else:
        models = [args.model] if args.model and args.model != "all" else list(shapes.VIDEO_MODELS)
        calls = sparse_bench.calls_for(models, args.res, factor)
        if not calls:
            parser.error(f"--sparse: {', '.join(models)} has no long self-attention call; use a video model "
                         f"({', '.join(shapes.VIDEO_MODELS)}) or --sparse-call")
    doc = sparse_bench.run(calls, dtypes[0], device, max(1, args.sparse_rounds), args.sparse_topk, settings)
    _print(sparse_bench.render(doc))
    if args.plot:
        bench.plot_sparse(doc, args.plot)
        _print(f"chart written to {args.plot}")
    if args.json_path:
        _save_json(doc, args.json_path)
        _print(f"\nJSON written to {args.json_path}")
    return 0


def _bench(args, parser: argparse.ArgumentParser) -> int:
    if args.plot:
        missing = bench.matplotlib_missing()
        if missing:
            parser.error(missing)
    if args.sparse:
        return _sparse_bench(args, parser)
    device = _device(args.device, parser)
    dtypes = _dtypes(args.dtype, parser)
    backends = _split(args.backends)
    try:
        bench.resolve_columns(backends)
    except ValueError as exc:
        parser.error(str(exc))
    models = _models(args.model, args.res, device, parser)
    if args.video_scale is not None and args.video_scale < 1:
        parser.error(f"--video-scale {args.video_scale}: must be a whole number of 1 or more")
    try:
        schedule = lib_schedule.parse(bench.SCHEDULE if args.schedule is None else args.schedule)
    except ValueError as exc:
        parser.error(f"--schedule: {exc}")
    settings = bench.BenchSettings(models=models, res=args.res,
                                   dtypes=[dtype_name(d) for d in dtypes] if dtypes else None,
                                   backends=backends, device=str(device), budget_s=args.budget,
                                   overhead=not args.no_overhead, overhead_rounds=args.overhead_rounds,
                                   schedule=schedule.text if schedule is not None else None,
                                   memory=not args.no_memory, progress=not args.no_progress, tune=args.tune,
                                   video_scale=args.video_scale)
    doc = bench.run(settings)
    _print(bench.render(doc))
    if args.json_path:
        _save_json(doc, args.json_path)
        _print(f"\nJSON written to {args.json_path}")
    if args.plot:
        bench.plot(doc, args.plot)
        _print(f"chart written to {args.plot}")
    return 0


def _tune(args, parser: argparse.ArgumentParser) -> int:
    if args.clear:
        removed = tuning_file.clear()
        _print(f"{'removed' if removed else 'no stored results at'} {tuning_file.cache_path()}")
        if args.model is None and args.res is None and args.dtype is None:
            return 0
    device = _device(args.device, parser)
    dtypes = _dtypes(args.dtype, parser)
    models = _models(args.model, args.res, device, parser)
    rows = tune_command.run(models, args.res, dtypes, device)
    _print(tune_command.render(rows, device))
    return 0


def _parallel(args, parser: argparse.ArgumentParser) -> int:
    models = args.model or list(parallel_command.DEFAULT_MODELS)
    try:
        for m in models:
            shapes.model_calls(m, args.res)
        if args.dtype:
            parse_dtype(args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    if args.scale is not None and args.scale < 1:
        parser.error(f"--scale {args.scale}: must be a whole number of 1 or more")
    if args.as_rank:
        parallel_command.rank_main(models, args.res, args.dtype, args.scale, args.repeat, args.timeout)
        return 0
    ranks = args.ranks or max(2, torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if ranks < 2:
        parser.error(f"--ranks {ranks}: needs 2 or more")
    if torch.cuda.is_available() and ranks > torch.cuda.device_count():
        parser.error(f"--ranks {ranks}: this machine has {torch.cuda.device_count()} GPU(s); NCCL needs one per rank")
    argv = ["--model", *models, "--repeat", str(args.repeat), "--timeout", str(args.timeout)]
    argv += (["--res", str(args.res)] if args.res else []) + (["--dtype", args.dtype] if args.dtype else [])
    argv += ["--scale", str(args.scale)] if args.scale else []
    doc = parallel_command.run(ranks, argv, timeout=2 * args.timeout)
    if args.json:
        _print_json(doc)
    else:
        _print(parallel_command.render(doc))
    return 0 if doc["ok"] else 1


COMMANDS = {"doctor": _doctor, "bench": _bench, "tune": _tune, "parallel": _parallel}


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS.get(args.command)
    if command is None:
        parser.print_help()
        return 2
    return command(args, parser)
