#!/usr/bin/env bash
# Issue 24's GPU checks in one device call (~5 min on one H100): the GPU structured-output
# tests, then bench/structured_gpu.py (batch 64, Qwen3-0.6B-shaped dummy model, json_schema vs
# unconstrained; goal <= 10% slower). Needs the llguidance wheel in .whl/ (pip download
# --python-version 3.12 --only-binary=:all: llguidance).
#   OUT=/tmp/out bash bench/structured_gpu_run.sh [bench args, e.g. --modes unconstrained,json_schema]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
head -2 "$OUT/machine.txt"
if ! python3 -c "import llguidance, jsonschema" 2>"$OUT/import-error.txt"; then
    echo "llguidance or jsonschema is missing: put their wheels in .whl/ ($(cat "$OUT/import-error.txt"))"
    exit 2
fi
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 120 \
        tests/core/test_structured_gpu.py 2>&1 | tee "$OUT/structured-gpu-tests.log" | tail -8
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 330 python3 bench/structured_gpu.py "$OUT/bench" "$@" 2>&1 | tail -20
fi
