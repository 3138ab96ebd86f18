"""Test double of A1111 1.10.1's `launch` module (host-contract A6, D1).

The real module re-exports `modules.launch_utils`; extension installers reach it through
`import launch` because the webui puts its root on PYTHONPATH when it runs `<ext>/install.py`.

Members, as the host has them:
- `args`: `parse_known_args()` of `sys.argv` plus `$COMMANDLINE_ARGS` (launcher flags only here).
- `python`: the interpreter running the webui; `index_url`: `$INDEX_URL` or "".
- `is_installed(package)`: `importlib.metadata.distribution`, then `importlib.util.find_spec`.
- `run(command, desc, errdesc, custom_env, live) -> str`: a shell command; raises RuntimeError
  on a non-zero exit.
- `run_pip(command, desc, live)`: `"<python>" -m pip <command> --prefer-binary [--index-url ..]`;
  does nothing under `--skip-install`.

Test-only addition: when `$LAUNCH_DOUBLE_PIP_LOG` names a file, every command line that
`run_pip` would run (or skips) is appended to it, so tests can see what an installer asked pip.
Where pip looks for packages is left to pip's own environment (`PIP_*` variables), which the
tests point at local folders.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import subprocess
import sys

python = sys.executable
index_url = os.environ.get("INDEX_URL", "")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    for flag in (
        "--skip-install",
        "--skip-prepare-environment",
        "--skip-torch-cuda-test",
        "--skip-version-check",
        "--reinstall-xformers",
        "--reinstall-torch",
        "--xformers",
        "--disable-all-extensions",
        "--disable-extra-extensions",
    ):
        parser.add_argument(flag, action="store_true")
    argv = sys.argv[1:] + shlex.split(os.environ.get("COMMANDLINE_ARGS", ""))
    known, _unknown = parser.parse_known_args(argv)
    return known


args = _parse_args()


def is_installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


def run(command, desc=None, errdesc=None, custom_env=None, live=False) -> str:
    if desc is not None:
        print(desc)
    env = os.environ if custom_env is None else custom_env
    if live:
        result = subprocess.run(command, shell=True, env=env)
        if result.returncode != 0:
            raise RuntimeError(
                f"{errdesc or 'Error running command'}.\n"
                f"Command: {command}\nError code: {result.returncode}"
            )
        return ""
    result = subprocess.run(command, shell=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if result.returncode != 0:
        message = [
            f"{errdesc or 'Error running command'}.",
            f"Command: {command}",
            f"Error code: {result.returncode}",
        ]
        if result.stdout:
            message.append(f"stdout: {result.stdout.decode(errors='replace')}")
        if result.stderr:
            message.append(f"stderr: {result.stderr.decode(errors='replace')}")
        raise RuntimeError("\n".join(message))
    return result.stdout.decode(errors="replace") if result.stdout else ""


def _log_pip(line: str) -> None:
    path = os.environ.get("LAUNCH_DOUBLE_PIP_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def run_pip(command, desc=None, live=False):
    if args.skip_install:
        _log_pip(f"SKIPPED {command}")
        return
    index_url_line = f" --index-url {index_url}" if index_url != "" else ""
    line = f'"{python}" -m pip {command} --prefer-binary{index_url_line}'
    _log_pip(line)
    return run(line, desc=f"Installing {desc}", errdesc=f"Couldn't install {desc}", live=live)
