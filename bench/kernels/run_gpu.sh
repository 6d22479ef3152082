#!/usr/bin/env bash
# One GPU call: install kvpilot, run the kernel tests compiled (fp16/fp32 tables plus the
# bf16 GPU tests), then the attention benchmarks; everything lands in $OUT.
#   run from the repository root:  OUT=/tmp/out bash bench/kernels/run_gpu.sh [bench ...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/nvidia-smi.csv"
cat "$OUT/nvidia-smi.csv"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
python3 -c "import torch, triton, kvpilot.kernels.rmsnorm; print(torch.__version__, triton.__version__)"
python3 -m pytest -q -p no:cacheprovider "${PYTEST_ARGS:-tests/kernels}" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
for bench in "${@:-bench/kernels/attention_bench.py}"; do
  python3 "$bench" --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" | tail -40
done
