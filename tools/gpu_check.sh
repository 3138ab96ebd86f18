#!/usr/bin/env bash
# One-shot check on a CUDA machine: the GPU tests and the full attention benchmark, in under
# 8 minutes, with every log and JSON file in one folder.
#
#   bash tools/gpu_check.sh [OUTPUT_DIR]     (default: $OUT, else ./gpu-check-out)
#
# Needs only a Python with a CUDA build of torch (set PYTHON to choose one); pytest is used
# when present. Writes: summary.txt (environment, doctor, step results), doctor.json,
# pytest.log, bench.txt, bench.json, bench-fp32.json and bench.png (when matplotlib is present).
set -uo pipefail
cd "$(dirname "$0")/.."

out="${1:-${OUT:-./gpu-check-out}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1

py="${PYTHON:-}"
if [ -z "$py" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1; then py="$candidate"; break; fi
    done
fi
if [ -z "$py" ] || ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "gpu_check: no Python with torch found (set PYTHON=/path/to/python)" | tee -a "$summary"
    exit 2
fi

start=$SECONDS
failed=0
note() { echo "$*" | tee -a "$summary"; }

# step NAME LIMIT_SECONDS STDOUT_FILE STDERR_FILE COMMAND...: runs with a time limit and records
# its status and duration in the summary.
step() {
    local name="$1" limit="$2" log="$3" errlog="$4"; shift 4
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>>"$errlog"
    rc=$?
    if [ "$rc" -eq 5 ] && [[ "$*" == *" -m pytest "* ]]; then
        note "$name: no tests were collected"
        rc=0
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after ${limit}s (log: $(basename "$log"))"
    elif [ "$rc" -ne 0 ]; then
        note "$name: FAILED, exit $rc (log: $(basename "$log"))"
    else
        note "$name: ok"
    fi
    note "  took $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || failed=1
    return 0
}

{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
    echo "python: $(command -v "$py") $("$py" -c 'import platform; print(platform.python_version())')"
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    if command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1; then
        echo "commit: $(git rev-parse HEAD 2>/dev/null || echo none) ($(git status --porcelain 2>/dev/null | wc -l) files changed)"
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    fi
    echo
} >>"$summary" 2>&1

models=all
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    note "gpu_check: this torch sees no CUDA device; the results below are CPU results (SD1.5 only)"
    models=sd15
fi

step "doctor" 45 "$summary" "$summary" "$py" -m lib_attn doctor
: >"$out/doctor.json"
step "doctor --json" 45 "$out/doctor.json" "$summary" "$py" -m lib_attn doctor --json

if ! "$py" -c 'import pytest' >/dev/null 2>&1; then
    # Offline machines answer quickly: no retries, short timeouts.
    timeout 30 "$py" -m pip install --quiet --retries 0 --timeout 5 pytest >>"$out/pytest.log" 2>&1 || true
fi
if "$py" -c 'import pytest' >/dev/null 2>&1; then
    step "pytest tests/gpu" 170 "$out/pytest.log" "$out/pytest.log" "$py" -m pytest tests/gpu -v -rs --durations=10
else
    note "pytest tests/gpu: SKIPPED, pytest is not installed and could not be installed"
    failed=1
fi

plot=()
if "$py" -c 'import matplotlib' >/dev/null 2>&1; then
    plot=(--plot "$out/bench.png")
else
    note "bench: no chart, matplotlib is not installed"
fi
step "bench ($models, native dtypes)" 180 "$out/bench.txt" "$out/bench.txt" \
    "$py" -m lib_attn bench --model "$models" --json "$out/bench.json" ${plot[@]+"${plot[@]}"}
remaining=$((470 - (SECONDS - start)))
if [ "$models" != all ]; then
    :  # on a CPU the run above already used fp32 inputs
elif [ "$remaining" -gt 40 ]; then
    limit=$((remaining < 120 ? remaining - 10 : 120))
    echo >>"$out/bench.txt"
    step "bench (SD1.5, fp32 inputs)" "$limit" "$out/bench.txt" "$out/bench.txt" \
        "$py" -m lib_attn bench --model sd15 --dtype fp32 --no-overhead --json "$out/bench-fp32.json"
else
    note "bench (SD1.5, fp32 inputs): SKIPPED, too little of the 8 minutes left"
fi

note ""
note "total $((SECONDS - start))s; files in $out:"
ls -l "$out" | tail -n +2 | tee -a "$summary"
exit "$failed"
