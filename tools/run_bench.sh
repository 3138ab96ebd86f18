#!/usr/bin/env bash
# Sets up .venv when needed (tools/setup_dev.sh) and runs the attention benchmark:
# on a CPU machine, SD1.5's attention calls through every available backend.
# Extra arguments go to `python -m lib_attn bench` (see --help), e.g. --model sdxl --plot bench.png
set -euo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python -c 'import lib_attn, torch' >/dev/null 2>&1; then
    bash tools/setup_dev.sh
fi
exec .venv/bin/python -m lib_attn bench "$@"
