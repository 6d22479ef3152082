#!/usr/bin/env bash
# Issue 44 on one GPU, one call (~7 min): the piecewise GPU tests; mixed steps (64 decodes +
# an N-token prompt every step) eager (KVPILOT_PIECEWISE_GRAPHS=0) against piecewise graphs,
# each a fresh process; Poisson serving at 50% and 80% of saturation, 0.6B shape with
# piecewise graphs on and off, 8B shape on. At most 8 files come back: logs are concatenated.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  | tee "$OUT/machine.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 80 \
  tests/kernels/test_cuda_graphs.py -k "piecewise or triton_engine" 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
for spec in "0.6b 96 0" "0.6b 96 x" "0.6b 448 0" "0.6b 448 x" "8b 448 0" "8b 448 x"; do
  set -- $spec; [ "$3" = x ] && set -- "$1" "$2" ""
  KVPILOT_PIECEWISE_GRAPHS=$3 timeout 80 python3 bench/step_profile_gpu.py "/tmp/p-$1-c$2-m$3" \
    --tp 1 --shape "$1" --batch 64 --chunk "$2" --steps 16 > /tmp/step.log 2>&1
  { echo "== $1 chunk $2 piecewise=${3:-on}"; grep -v '^ *[{}\["]' /tmp/step.log | grep -v '^ *[0-9.]*,\?$' | head -45; } >> "$OUT/steps.log"
  echo "$1 chunk $2 piecewise=${3:-on}: $(grep -m1 'ms/step wall' /tmp/step.log | cut -c1-100)"
  grep -m1 "mixed steps of a chunk" /tmp/step.log | cut -c1-150
done
timeout 200 python3 bench/poisson_gpu.py --out "$OUT/poisson06" --shapes 0.6b --modes on,off \
  --requests 200 > /tmp/poisson06.log 2>&1; tail -14 /tmp/poisson06.log
timeout 130 python3 bench/poisson_gpu.py --out "$OUT/poisson8b" --shapes 8b --modes on \
  --requests 200 > /tmp/poisson8b.log 2>&1; tail -8 /tmp/poisson8b.log
