#!/usr/bin/env bash
# Issue 24's LoRA GPU checks in one device call (~5 min on one H100): the GPU LoRA tests (the
# SGMV kernel against its reference, the engine with graphs against HF + PEFT), then
# bench/lora_gpu.py (batch 64 over 8 adapters vs the base model; goal ratio >= 0.8). Needs the
# peft wheel in .whl/ for the engine test (pip download --python-version 3.12
# --only-binary=:all: --no-deps peft); without it that test is skipped, the rest runs.
#   OUT=/tmp/out bash bench/lora_gpu_run.sh [bench args, e.g. --modes base,lora8]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
head -2 "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    tests="tests/kernels/test_lora_sgmv.py"
    if python3 -c "import peft" 2>/dev/null; then
        tests="$tests tests/lora/test_lora_gpu.py"
    else
        echo "peft is missing: skipping tests/lora/test_lora_gpu.py (put its wheel in .whl/)"
    fi
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 150 $tests 2>&1 \
        | tee "$OUT/lora-gpu-tests.log" | tail -8
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 300 python3 bench/lora_gpu.py "$OUT/bench" "$@" 2>&1 | tail -12
fi
