#!/usr/bin/env bash
# One GPU call for issues 7 and 21: install kvpilot, run the kernel tests compiled (fp16/fp32 tables,
# bf16 GPU tests, engine greedy parity), then a)/b) attention and c)/d) end-to-end benchmarks.
# Everything lands in $OUT (JSON, markdown, logs). From the repository root:
#   OUT=/tmp/out bash bench/kernels/run_gpu.sh        # about 10 minutes on one H100
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
# one log for everything: the device returns at most 8 files
LOG="$OUT/gpu-run.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$LOG" \
  | grep -E "^E |passed|failed"
# c) and d) run as separate processes: each sizes its KV cache from the whole GPU
timeout 200 python3 bench/e2e_gpu.py --only c --out "$OUT" >> "$LOG" 2>&1
timeout 120 python3 bench/e2e_gpu.py --only d --out "$OUT" >> "$LOG" 2>&1
timeout 480 python3 bench/kernels/attention_bench.py --out "$OUT" >> "$LOG" 2>&1
cat "$OUT"/e2e_gpu_c.md "$OUT"/e2e_gpu_d.md "$OUT"/attention.md
