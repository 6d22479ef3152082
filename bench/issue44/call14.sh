#!/usr/bin/env bash
# Call 14 (one H200): call 11's 131,072-token prefill (bench/long_prefill_gpu.py, kernel and
# engine parts) on the GPU the issue names, from the tree that also keeps the gathered keys'
# memory free beside the KV cache (the engine part sizes its cache through that code).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/c14"
source bench/device_env.sh
python3 -c "import tokenizers" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --target /tmp/site .whl/optional/tokenizers*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/c14/machine.txt"
timeout 420 python3 bench/long_prefill_gpu.py --out "$OUT/c14" --parts kernel,engine \
  > "$OUT/c14/run.log" 2>&1
grep -E "^engine|_tflops|vs_|Error|error|KV cache" "$OUT/c14/run.log" | grep -v Warning | tail -20 | cut -c1-300
tar czf "$OUT/call14.tgz" -C "$OUT" c14 && rm -rf "$OUT/c14"
