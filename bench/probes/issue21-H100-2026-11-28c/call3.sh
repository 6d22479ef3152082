#!/usr/bin/env bash
# session 15, call 3: the Gluon prefill kernel's output by TMA, A/B against HEAD in one process; its GPU tests
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
T0=$(date +%s)
PYTHONPATH=calls:$PYTHONPATH DIAG=1 timeout 300 python3 calls/gdiag.py > "$OUT/gdiag.log" 2>&1
echo "gdiag exit $? at $(( $(date +%s) - T0 )) s"; grep -v -i warn "$OUT/gdiag.log" | tail -12 | cut -c1-1200
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_prefill_attention_gluon.py tests/kernels/test_triton_backend.py > "$OUT/gpu-tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; tail -2 "$OUT/gpu-tests.log" | cut -c1-300; grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -10 | cut -c1-300
