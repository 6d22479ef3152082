#!/usr/bin/env bash
# Call 16 (issue 44 item 4): structured outputs with xgrammar (the default backend, auto)
# beside llguidance, and LoRA, at the Qwen3-0.6B and Llama-3-8B shapes, batch 64, each ratio
# from engines of this call (bench/issue44/structured_lora.sh); first the structured-output
# GPU tests (outputs validate on CUDA under the default backend). Writes $OUT/.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
python3 -c 'import xgrammar, llguidance; print("xgrammar and llguidance import")' 2>&1 | tee "$OUT/imports.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/core/test_structured_gpu.py \
  tests/core/test_structured_xgrammar.py 2>&1 | tail -5 | tee "$OUT/gpu-tests.log"
bash bench/issue44/structured_lora.sh
