#!/usr/bin/env bash
# Issue 16's GPU checks on a 4-GPU host, in one device call: the GPU parallel tests (TP=2,
# TP=4, EP=4 vs TP=1 under the top-5 rule), then (unless TESTS_ONLY=1) bench/parallel_gpu.py.
#   OUT=/tmp/out bash bench/parallel_gpu_run.sh [bench args, e.g. --tp 1,2,4]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m; } \
    > "$OUT/machine.txt" 2>&1
head -4 "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 200 -o faulthandler_timeout=190 \
        tests/parallel/test_parallel_gpu.py 2>&1 | tee "$OUT/parallel-gpu-tests.log" | tail -15
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 330 python3 bench/parallel_gpu.py "$OUT/bench" "$@" 2>&1 | tail -40
fi
