#!/usr/bin/env bash
# Call 13 (one H100): issue 44's LoRA line (8 adapters against the base at both shapes,
# bench/issue44/structured_lora.sh's lora parts) and the 8B shape's Poisson serving at a
# 512-token step budget (50% and 80% of saturation, full mixed graphs), on an H100: the
# H200 gave LoRA 0.809x (0.6B) / 0.764x (8B) and 8B ITL p99/p50 2.19 / 2.28 (call 10, call 8).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/c13"
OUT=$OUT/c13/lora ONLY=lora-0.6b,lora-8b bash bench/issue44/structured_lora.sh 2>&1 | tail -12
source bench/device_env.sh
timeout 300 python3 bench/poisson_gpu.py --out "$OUT/c13/poisson8b" --shapes 8b --modes full \
  --requests 200 --max-num-batched-tokens 512 > "$OUT/c13/poisson8b.log" 2>&1
tail -8 "$OUT/c13/poisson8b.log" | cut -c1-400
tar czf "$OUT/call13.tgz" -C "$OUT" c13 && rm -rf "$OUT/c13"
