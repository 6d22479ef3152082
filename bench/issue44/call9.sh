#!/usr/bin/env bash
# Issue 44, call 9: before/after in one call. The nano-vllm recipe (rate inf, 0.6B) and
# batch-1 decode (8B) with mixed-step graphs off (the path before issue 44) and full;
# time to ready, cold and warm compile cache, with the first request after ready (after the
# warm-up's lone temperature-only wave); Poisson at 50%/80% for the 8B shape with a 256-token
# step budget (at 512, a 448-token chunk beside 64 decodes is GPU-bound at 2.4x a decode step).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
for mode in 0 ""; do
  label=${mode:-full}; [ "$label" = 0 ] && label=off
  KVPILOT_PIECEWISE_GRAPHS=$mode timeout 120 python3 bench/e2e_gpu.py --out "$OUT/recipe-$label" \
    --only c --hf-requests 0 2>&1 | tail -3 | cut -c1-400 | sed "s/^/recipe $label: /"
  KVPILOT_PIECEWISE_GRAPHS=$mode timeout 120 python3 bench/e2e_gpu.py --out "$OUT/batch1-$label" \
    --only d 2>&1 | tail -3 | cut -c1-400 | sed "s/^/batch1 $label: /"
done
timeout 150 python3 bench/time_to_ready.py --out "$OUT/ttr06" --shape 0.6b 2>&1 | tail -12 | cut -c1-400
timeout 200 python3 bench/poisson_gpu.py --out "$OUT/poisson8b-256" --shapes 8b --modes full \
  --requests 200 --max-num-batched-tokens 256 > /tmp/poisson8b.log 2>&1; tail -7 /tmp/poisson8b.log
