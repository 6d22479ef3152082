#!/usr/bin/env bash
# Issue 44 on one GPU, one call (~9 min): full mixed-step graphs (attention inside, the
# unified kernel). The GPU tests of the unified kernel and of the mixed graphs against eager;
# step times of 64 decodes alone (decode graph) and beside an N-token prompt (full graphs);
# Poisson serving at 50% and 80% of saturation, 0.6B shape, full graphs against eager mixed
# steps (the path before issue 44), each with its rate-inf recipe run.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  | tee "$OUT/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 120 \
  tests/kernels/test_unified_attention.py tests/kernels/test_cuda_graphs.py -k "unified or piecewise" \
  2>&1 | tail -6 | tee "$OUT/gpu-tests.log"
for spec in "0.6b 0" "0.6b 96" "0.6b 448" "8b 0" "8b 448"; do
  set -- $spec
  chunk=(); [ "$2" != 0 ] && chunk=(--chunk "$2")
  timeout 70 python3 bench/step_profile_gpu.py "/tmp/p-$1-c$2" --tp 1 --shape "$1" --batch 64 \
    "${chunk[@]}" --steps 16 > /tmp/step.log 2>&1
  { echo "== $1 chunk $2"; grep -v '^ *[{}\["]' /tmp/step.log | grep -v '^ *[0-9.]*,\?$' | head -40; } >> "$OUT/steps.log"
  echo "$1 chunk $2: $(grep -m1 'ms/step wall' /tmp/step.log | cut -c1-110)"
  grep -m1 "mixed steps of a chunk" /tmp/step.log | cut -c1-150
done
timeout 230 python3 bench/poisson_gpu.py --out "$OUT/poisson06" --shapes 0.6b --modes full,off \
  --requests 200 > /tmp/poisson06.log 2>&1; tail -14 /tmp/poisson06.log
