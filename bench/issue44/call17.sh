#!/usr/bin/env bash
# Call 17 (issue 44 item 4): call 16 again where it fell short. Structured outputs at the
# Qwen3-0.6B shape with xgrammar (the default) beside llguidance, batch 64 (call 16's 0.6B
# part ran past its 100 s limit on a cold H100), the structured-output GPU tests (call 16's
# could not import jsonschema; its wheel is now in .whl/), then the 8B shape. Writes $OUT/.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
python3 -c 'import xgrammar, llguidance, jsonschema; print("xgrammar, llguidance and jsonschema import")' 2>&1 | tee "$OUT/imports.txt"
ONLY=structured-0.6b bash bench/issue44/structured_lora.sh
mkdir -p "$OUT/tests"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_structured_gpu.py \
  tests/core/test_structured_xgrammar.py 2>&1 | tail -8 | tee "$OUT/tests/gpu-tests.log"
ONLY=structured-8b bash bench/issue44/structured_lora.sh
