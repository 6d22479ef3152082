#!/usr/bin/env bash
# Call 18 (issue 44 item 4), prepared after call 17: why xgrammar's 64-row fill took 4.9 ms on
# the H100 host's 15 fill threads. xgrammar builds and joins a new thread pool on every batch
# fill; first the cost of that per thread count (bench/xgrammar_pool_probe.py), then the
# 0.6B shape's json_schema (xgrammar) at 2, 4 and 8 fill threads beside the default (15)
# and length-matched unconstrained requests, one engine each. Writes $OUT/. ~4 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; } | tee "$OUT/machine.txt"
timeout 60 python3 bench/xgrammar_pool_probe.py --threads 1,2,4,8,15 2>&1 | grep -v Warning \
  | tee "$OUT/pool_probe.json"
timeout 420 python3 bench/structured_gpu.py "$OUT/structured-0.6b-threads" --shape 0.6b \
  --no-checks --modes json_schema,unconstrained_matched --fill-threads 2,4,8 \
  > "$OUT/logs.txt" 2>&1
echo "exit $?"
grep -h "^| \|^slowdown" "$OUT/structured-0.6b-threads/results.md" | cut -c1-200
