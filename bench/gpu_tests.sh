#!/usr/bin/env bash
# The GPU tests in one device call: every `gpu`-marked test plus the kernel and model tests,
# which run on CUDA when a GPU is visible (Triton compiled, bf16 included). Log to $OUT.
#   OUT=/tmp/out bash bench/gpu_tests.sh [extra pytest args]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu-tests.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu-tests.log"
timeout 540 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 300 \
    tests/kernels tests/models "$@" \
    tests/core/test_gpu_engine.py tests/core/test_async_scheduling.py \
    tests/disagg/test_disagg_engine_store.py tests/disagg/test_disagg_engines.py \
    2>&1 | tee -a "$OUT/gpu-tests.log" | tail -40
