#!/usr/bin/env bash
# Call 10 (one H200): issue 44 item 4 (bench/issue44/structured_lora.sh, without its CPU-only
# part) and issue 48's chaos and drain on the GPU (bench/issue48/gpu_chaos.sh). The call
# brings back at most 8 files: each script's folder comes back in one tarball.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT=$OUT/s ONLY=structured-0.6b,lora-0.6b,structured-8b,lora-8b bash bench/issue44/structured_lora.sh 2>&1 | tail -30
OUT=$OUT/c CHAOS_BUDGET_S=215 bash bench/issue48/gpu_chaos.sh > /dev/null 2>&1
tail -40 "$OUT/c/run.log"
tar czf "$OUT/call10.tgz" -C "$OUT" s c && rm -rf "$OUT/s" "$OUT/c"
