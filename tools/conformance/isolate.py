"""Run one conformance case in a fresh interpreter: several releases of one package cannot share a process.

``run("tools.conformance.test_flash_attn:case", "2.8.3", ...)`` starts
``python -m tools.conformance.isolate module:function args...`` at the repository root; the function
gets the arguments as strings and fails by raising. Its output is shown when it fails.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

from .sources import ROOT


def run(target: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    result = subprocess.run([sys.executable, "-m", "tools.conformance.isolate", target, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{target}{list(args)} failed (exit {result.returncode}):\n{result.stdout[-6000:]}")
    return result.stdout


def main(argv: list[str]) -> int:
    module, _, function = argv[0].partition(":")
    getattr(importlib.import_module(module), function)(*argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
