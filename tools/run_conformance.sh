#!/usr/bin/env bash
# The conformance suite (tools/conformance): the engine's kernel calls run through the real Python of
# the kernel packages' releases, fetched from PyPI at test time into .conformance-cache/ (never
# committed). Creates .venv-conformance on first use: torch==$TORCH_VERSION (default 2.13.0, the
# CPU build), pytest, numpy and triton (SageAttention's Triton kernels run under TRITON_INTERPRET=1).
# Extra arguments go to pytest. Exit status: pytest's, except that "no tests ran" fails too.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-conformance
PYTHON="${PYTHON:-python3}"

if ! "$VENV/bin/python" -c 'import torch, pytest, numpy, triton' >/dev/null 2>&1; then
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed")' || exit 1
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 1
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install "torch==${TORCH_VERSION:-2.13.0}" || exit 1
    fi
    # setuptools and wheel: flash-attn's and xformers' setup.py run (without build isolation) to name their sdists.
    "$VENV/bin/python" -m pip install pytest numpy triton setuptools wheel packaging || exit 1
fi
export TRITON_INTERPRET=1
"$VENV/bin/python" -m pytest tools/conformance -q -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "conformance: pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
