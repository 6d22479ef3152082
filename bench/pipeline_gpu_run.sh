#!/usr/bin/env bash
# Issue 16 part B's GPU checks on a 4-GPU host, in one device call: the pipeline GPU tests
# (PP=2 on 2 GPUs, TP=2 x PP=2 on 4, each vs TP=1 under the top-5 rule), then (unless
# TESTS_ONLY=1) bench/pipeline_gpu.py (8B-shaped: TP=1 graphs/eager, PP=2, PP=4, TP=2 x PP=2).
#   OUT=/tmp/out bash bench/pipeline_gpu_run.sh [bench args, e.g. --configs tp1-eager,pp2]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m; } \
    > "$OUT/machine.txt" 2>&1
head -4 "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 180 -o faulthandler_timeout=170 \
        tests/parallel/test_parallel_gpu.py -k "pp2" 2>&1 | tee "$OUT/pipeline-gpu-tests.log" | tail -15
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 320 python3 bench/pipeline_gpu.py "$OUT/bench" "$@" 2>&1 | tail -30
fi
