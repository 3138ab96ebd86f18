#!/usr/bin/env bash
# The InvokeAI part (tests/invokeai): InvokeAI 6.14.2's app layer imports torchvision, which has no CPU
# build this CI can install, so tests/doubles/invokeai stands in for that layer while InvokeAI's own
# backend modules (FLUX's attention and layers, ...) are the real release's files. Creates .venv-invokeai
# on first use: Python 3.11 or 3.12 (InvokeAI 6.14.2 needs >=3.11,<3.13; $PYTHON, else python3,
# python3.12 or python3.11 from PATH), torch==$TORCH_VERSION
# (default 2.13.0, the CPU build; installed first so that nothing pulls a CUDA build), pydantic 2,
# diffusers 0.40.0 and numpy<2 (InvokeAI 6.14.2's pins), einops, safetensors, Pillow, pytest, and
# invokeai==6.14.2 itself without its dependencies.
# Extra arguments go to pytest. Exit status: pytest's, except that "no tests ran" fails too.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-invokeai

in_range() { "$1" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)' >/dev/null 2>&1; }

# $PYTHON when set (used or refused, never replaced), else the first of python3, python3.12, python3.11 that
# InvokeAI 6.14.2 accepts.
find_python() {
    local c
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
        return
    fi
    for c in python3 python3.12 python3.11; do
        if in_range "$c"; then
            command -v "$c"
            return
        fi
    done
    echo python3
}

ready() {
    "$VENV/bin/python" -c 'import torch, pydantic, pytest, numpy, einops, diffusers, safetensors, PIL
import importlib.metadata as m, sys
sys.exit(0 if m.version("invokeai") == "6.14.2" and pydantic.VERSION.startswith("2.")
         and numpy.__version__.startswith("1.") else 1)' >/dev/null 2>&1
}

if ! ready; then
    py="$(find_python)"
    if ! in_range "$py"; then
        echo "invokeai: InvokeAI 6.14.2 needs Python >=3.11,<3.13; $py is" \
            "$("$py" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo 'not found')" \
            "(set PYTHON=/path/to/python3.11 or 3.12)" >&2
        exit 2
    fi
    started=$SECONDS
    [ -x "$VENV/bin/python" ] && ! in_range "$VENV/bin/python" && rm -rf "$VENV"
    [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV" || exit 2
    pip_install() { "$VENV/bin/python" -m pip install --quiet "$@"; }
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        pip_install "torch==${TORCH_VERSION:-2.13.0}" || exit 2
    fi
    # The torch pin again, so that no dependency can replace the CPU build.
    pip_install "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" \
        "pydantic>=2" pytest "numpy<2.0.0" einops "diffusers==0.40.0" safetensors Pillow || exit 2
    # --no-deps: its dependencies include torchvision (a CUDA build here) and its whole app stack; the tests
    # import only its backend modules from it.
    pip_install --no-deps "invokeai==6.14.2" || exit 2
    ready || { echo "invokeai: $VENV is incomplete after installing" >&2; exit 2; }
    echo "invokeai: $VENV ready in $((SECONDS - started)) s"
fi

"$VENV/bin/python" -m pytest tests/invokeai -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "invokeai: pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
