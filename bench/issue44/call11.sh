#!/usr/bin/env bash
# Call 11 (one H100 or H200): issue 44 item 5. The Gluon prefill kernel on sequences with a
# cached prefix (keys gathered from the paged cache): its GPU tests, then
# bench/long_prefill_gpu.py (a 131,072-token prompt, 8B shape: one layer's attention over
# every 8192-token chunk, Gluon+gather vs the Triton kernel vs torch's fastest SDPA over the
# whole prompt; then the engine's prefill with the gather on and off in one process).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/c11"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/c11/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -x \
  tests/kernels/test_prefill_attention_gluon.py tests/kernels/test_triton_backend.py \
  > "$OUT/c11/tests.log" 2>&1; tail -5 "$OUT/c11/tests.log"
timeout 150 python3 bench/long_prefill_gpu.py --out "$OUT/c11/kernel" > "$OUT/c11/kernel.log" 2>&1
tail -32 "$OUT/c11/kernel.log" | cut -c1-300
timeout 300 python3 bench/long_prefill_gpu.py --out "$OUT/c11/engine" --parts engine \
  > "$OUT/c11/engine.log" 2>&1; grep -E "^engine|tflops|gather_vs|Error|error" "$OUT/c11/engine.log" | tail -20 | cut -c1-300
tar czf "$OUT/call11.tgz" -C "$OUT" c11 && rm -rf "$OUT/c11"
