"""Starting N ranks on this machine, as torchrun would, and reading back what each reports.

``run_ranks(n, argv)`` starts ``n`` processes of ``python argv...`` with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``OMP_NUM_THREADS=1``
unless set) and a file for each to report into; ``run_torchrun`` starts them through torchrun
itself. A rank calls ``init()`` to join the group (NCCL when it has a GPU, else gloo), ``report(data)``
to hand back a JSON-ready result and ``finish()`` to leave the group and end. Ranks still running after the time
allowed are ended (by their own process id), and the result says so.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

RESULT_ENV = "LIB_ATTN_RANK_RESULT"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, argv: list, timeout: float = 120.0, env: dict | None = None) -> list[dict]:
    """Run ``n`` ranks of ``python argv`` and return, per rank: ``returncode`` (None when it had to be
    ended), ``result`` (what it reported, or None), ``output`` (the end of its stderr and stdout)."""
    port = free_port()
    # As torchrun does: one thread per rank, unless told otherwise (ranks sharing cores would spin).
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="lib_attn_ranks_") as folder:
        procs, logs = [], []
        for rank in range(n):
            rank_env = {**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        RESULT_ENV: os.path.join(folder, f"rank{rank}.json")}
            log = open(os.path.join(folder, f"rank{rank}.log"), "w+b")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(None)
        out = []
        for rank, (code, log) in enumerate(zip(codes, logs)):
            log.seek(0)
            text = log.read().decode("utf-8", "replace")
            log.close()
            out.append(_outcome(folder, rank, code, text))
        return out


def run_torchrun(n: int, argv: list, timeout: float = 120.0, env: dict | None = None) -> list[dict]:
    """As ``run_ranks``, through torchrun itself (``python -m torch.distributed.run``): one launcher
    process that starts the ``n`` ranks. ``output`` is then the launcher's, every rank's lines in it."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lib_attn_ranks_") as folder:
        run_env = {**os.environ, **(env or {}), RESULT_ENV: os.path.join(folder, "rank{rank}.json")}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
               f"--master-port={port}", *argv]
        try:
            done = subprocess.run(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
            code, text = done.returncode, done.stdout.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as exc:
            code, text = None, (exc.stdout or b"").decode("utf-8", "replace")
        return [_outcome(folder, rank, code, text) for rank in range(n)]


def _outcome(folder: str, rank: int, code, text: str) -> dict:
    """What one rank left: its exit status, the result it reported (or None), the end of its output."""
    path = os.path.join(folder, f"rank{rank}.json")
    result = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    return {"rank": rank, "returncode": code, "result": result, "output": text[-4000:]}


def init(timeout: float = 120.0, backend: str | None = None):
    """Join the group torchrun's environment describes: NCCL when this process has a GPU, else gloo."""
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size(), backend


def finish() -> None:
    """Leave the group and end this rank's process: every rank waits for the others (none leaves while
    another may still send to it), then the process ends at once, without the interpreter's exit.
    Tearing the group down is where a rank can stay: gloo's threads left to the interpreter's exit can
    abort the process, and once in CI on torch 2.1.2 a rank never ended after this barrier (its peers
    had). What a rank hands back is written before (``report``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(data) -> None:
    """Hand ``data`` (JSON-ready) back to ``run_ranks``; nothing when not started by it."""
    path = os.environ.get(RESULT_ENV, "").replace("{rank}", os.environ.get("RANK", "0"))
    if path:
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(path + ".part", path)
