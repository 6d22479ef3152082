#!/usr/bin/env bash
# Issue 44, item 1: where a mixed (decode + prompt chunk) step's time goes, before any change.
# One device call: bench/step_profile_gpu.py at batch 64 with an N-token prompt in every
# profiled step (cProfile of the host, torch.profiler of the GPU), 0.6B and 8B shapes.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  | tee "$OUT/machine.txt"
for spec in "0.6b 64 0" "0.6b 64 12" "0.6b 64 96" "8b 64 96"; do
  set -- $spec
  timeout 200 python3 bench/step_profile_gpu.py "$OUT/p-$1-c$3" --tp 1 --shape "$1" \
    --batch "$2" --chunk "$3" --steps 16 > "$OUT/p-$1-c$3.log" 2>&1
  grep -v "^ *{" "$OUT/p-$1-c$3.log" | head -60
done
