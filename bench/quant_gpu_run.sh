#!/usr/bin/env bash
# Issue 23's quantization checks on one H100, in one device call (about 8 minutes): the
# quantization GPU tests (torch._scaled_mm, the fp8-KV Triton kernels, the engine with
# 8-bit weights / KV), then bench/quant_gpu.py (batch-1 8B decode bf16/fp8/int8, the
# nano-vllm recipe bf16 vs fp8+fp8 KV, 4k-token sequences bf16 KV vs fp8 KV).
#   OUT=/tmp/out bash bench/quant_gpu_run.sh [bench args, e.g. --parts a]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | tee "$OUT/machine.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/machine.txt"
if [ "${BENCH_ONLY:-0}" != 1 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -s --timeout 140 \
        tests/quantization/test_quant_gpu.py 2>&1 | tee "$OUT/quant-gpu-tests.log" | tail -25
fi
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 360 python3 bench/quant_gpu.py "$OUT/bench" "$@" 2>&1 | tail -25
fi
