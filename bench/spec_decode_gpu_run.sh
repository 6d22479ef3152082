#!/usr/bin/env bash
# Issue 23's speculative-decoding GPU checks on one GPU, in one device call (~6 min): the GPU
# tests (greedy output unchanged on CUDA), then bench/spec_decode_gpu.py (Llama-3-8B shape,
# batch 1 and 32: base, draft = target, noised drafts, n-gram). Results under $OUT/bench
# (written after every scenario, so a run cut short keeps what it measured).
#   OUT=/tmp/out bash bench/spec_decode_gpu_run.sh [bench args, e.g. --k 3 --noise 0.05]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/machine.txt" 2>&1
head -2 "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 100 \
        tests/spec_decode/test_spec_gpu.py 2>&1 | tee "$OUT/spec-gpu-tests.log" | tail -8
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 400 python3 bench/spec_decode_gpu.py "$OUT/bench" "$@" 2>&1 | tail -30
fi
