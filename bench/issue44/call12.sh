#!/usr/bin/env bash
# Call 12 (one H100 or H200): issue 44's "the rate-inf recipe does not regress" for call 11's
# change: the nano-vllm recipe (0.6B shape, 256 requests, rate inf) with prefixed chunks on
# the Triton kernel (KVPILOT_GLUON_PREFIX=0, the code before) and on the Gluon kernel with
# gathered keys (the default), in turn, one call. Batch-1 decode has no prefill chunk after
# a prefix: not rerun.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/c12"
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/c12/machine.txt"
for mode in 0 1; do
  label=gather$mode
  KVPILOT_GLUON_PREFIX=$mode timeout 150 python3 bench/e2e_gpu.py --out "$OUT/c12/recipe-$label" \
    --only c --hf-requests 0 2>&1 | tail -3 | cut -c1-400 | sed "s/^/recipe $label: /"
done
tar czf "$OUT/call12.tgz" -C "$OUT" c12 && rm -rf "$OUT/c12"
