#!/usr/bin/env bash
# Issue 44 on one GPU: the GPU tests of the graph paths, then mixed steps (batch 64 decodes +
# an N-token prompt each step) eager (KVPILOT_PIECEWISE_GRAPHS=0) against piecewise graphs,
# each in a fresh process, with the decode-only step of the same batch (chunk 0) beside them.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  | tee "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 200 \
  tests/kernels/test_cuda_graphs.py tests/core/test_gpu_engine.py 2>&1 | tail -6 | tee "$OUT/gpu-tests.log"
run() {  # shape chunk mode
  KVPILOT_PIECEWISE_GRAPHS=$3 timeout 150 python3 bench/step_profile_gpu.py "$OUT/p-$1-c$2-m$3" \
    --tp 1 --shape "$1" --batch 64 --chunk "$2" --steps 16 > "$OUT/p-$1-c$2-m$3.log" 2>&1
  echo "$1 chunk $2 piecewise=${3:-on}: $(grep -m1 'ms/step wall' "$OUT/p-$1-c$2-m$3.log" | cut -c1-110)"
  grep -m1 "mixed steps of a chunk" "$OUT/p-$1-c$2-m$3.log" | cut -c1-160
}
for spec in "0.6b 0 x" "0.6b 96 0" "0.6b 96 x" "0.6b 448 0" "0.6b 448 x" "8b 0 x" "8b 448 0" "8b 448 x"; do
  set -- $spec; [ "$3" = x ] && set -- "$1" "$2" ""
  run "$1" "$2" "$3"
done
grep -h -A12 "host, own time" "$OUT"/p-0.6b-c96-m0.log | cut -c1-120
