#!/usr/bin/env bash
# Issue 44, one GPU: mixed steps (64 decodes + an N-token prompt every step) eager against
# piecewise graphs, the decode-only step of the same batch beside them (each a fresh
# process); then Poisson serving of the 0.6B shape, piecewise graphs on and off.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  | tee "$OUT/machine.txt"
mkdir -p "$OUT/steps"
run() {  # shape chunk mode
  KVPILOT_PIECEWISE_GRAPHS=$3 timeout 120 python3 bench/step_profile_gpu.py "/tmp/p-$1-c$2-m$3" \
    --tp 1 --shape "$1" --batch 64 --chunk "$2" --steps 16 > "$OUT/steps/p-$1-c$2-m$3.log" 2>&1
  echo "$1 chunk $2 piecewise=${3:-on}: $(grep -m1 'ms/step wall' "$OUT/steps/p-$1-c$2-m$3.log" | cut -c1-100)"
  grep -m1 "mixed steps of a chunk" "$OUT/steps/p-$1-c$2-m$3.log" | cut -c1-150
}
for spec in "0.6b 0 x" "0.6b 96 0" "0.6b 96 x" "0.6b 448 0" "0.6b 448 x" "8b 0 x" "8b 448 0" "8b 448 x"; do
  set -- $spec; [ "$3" = x ] && set -- "$1" "$2" ""
  run "$1" "$2" "$3"
done
timeout 330 python3 bench/poisson_gpu.py --out "$OUT/poisson" --shapes 0.6b --modes on,off \
  --requests 300 > "$OUT/poisson.log" 2>&1; tail -12 "$OUT/poisson.log"
