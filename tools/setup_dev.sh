#!/usr/bin/env bash
# Creates .venv in the repository and installs the engine with its test and plot extras.
#
# Assumes a CPU machine: when .venv has no torch yet it installs torch==$TORCH_VERSION
# (default 2.13.0) before anything else, so that no package can pull in a CUDA build.
# On a GPU machine install your torch into .venv first (or set TORCH_INSTALL to the pip
# arguments to use, e.g. TORCH_INSTALL="torch==2.7.1 --index-url https://download.pytorch.org/whl/cu128");
# an installed torch is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed")'

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)

if ! .venv/bin/python -c 'import importlib.metadata as m; m.version("torch")' >/dev/null 2>&1; then
    # shellcheck disable=SC2086 # TORCH_INSTALL is a list of pip arguments
    "${PIP[@]}" install ${TORCH_INSTALL:-torch==${TORCH_VERSION:-2.13.0}}
fi
"${PIP[@]}" install -e ".[test,plot]"
.venv/bin/python -c 'import lib_attn, torch; print("ready: torch", torch.__version__)'
