#!/usr/bin/env bash
# Issue 16's TP all-reduce over torch symmetric memory, in one device call on 2 GPUs (<= 7 min):
# its tests (the CPU ones too: they check this torch's op schemas; on GPUs symmetric memory gives
# NCCL's sums, eager and in a CUDA graph; the TP=2 engine decodes through it and matches TP=1),
# then bench/allreduce_gpu.py (NCCL vs symmetric-memory latency, 8 KiB..4 MiB; TP=1 vs TP=2
# with it on and off, Llama-3-8B shape, batch 1 and 64).
#   OUT=/tmp/out bash bench/allreduce_gpu_run.sh [bench args, e.g. --skip-latency]
# TESTS_ONLY=1 / BENCH_ONLY=1 run one half. NVLink multicast stays off (bench/device_env.sh).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 150 \
        -o faulthandler_timeout=140 -o log_cli=true -o log_cli_level=INFO \
        tests/parallel/test_symm_mem_all_reduce.py tests/parallel/test_symm_mem_startup.py \
        tests/parallel/test_symm_mem_all_reduce_gpu.py \
        > "$OUT/symm-mem-gpu-tests.log" 2>&1
    grep -E "all-reduce: |passed|failed|error" "$OUT/symm-mem-gpu-tests.log" | tail -12
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 250 python3 bench/allreduce_gpu.py "$OUT/bench" "$@" > "$OUT/bench.log" 2>&1
    echo "bench exit $?"
    grep -E "all-reduce: " "$OUT/bench.log" | sort | uniq -c | head -6
    if [ -f "$OUT/bench/results.md" ]; then cat "$OUT/bench/results.md"; else tail -30 "$OUT/bench.log"; fi
fi
