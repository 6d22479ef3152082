#!/usr/bin/env bash
# Issue 44, call 8: time to ready on a cold and a warm compile cache with the first request's
# slow steps logged (0.6B; call 7's first request after ready took 809 ms with full graphs),
# then Poisson serving at 50% and 80% of saturation, 8B shape, full graphs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
timeout 200 python3 bench/time_to_ready.py --out "$OUT/ttr06" --shape 0.6b 2>&1 | tail -40
timeout 300 python3 bench/poisson_gpu.py --out "$OUT/poisson8b" --shapes 8b --modes full \
  --requests 200 > /tmp/poisson8b.log 2>&1; tail -8 /tmp/poisson8b.log
