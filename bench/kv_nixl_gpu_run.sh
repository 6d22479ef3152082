#!/usr/bin/env bash
# Issue 22's NIXL checks on a 2-GPU host, in one device call (about 6 minutes):
#   1. the GPU NIXL test (prefill engine's VRAM caches READ by a decode engine) and the CPU
#      NIXL tests, on the device's Python;
#   2. bench/kv_nixl_gpu.py: TCP vs NIXL rate for the same blocks, cuda:0 -> cuda:1;
#   3. unless RATE_ONLY=1, bench/disagg_gpu.py --kv-transport nixl (8b, 2 long prompts/s,
#      30 s of load): long-prompt TTFT disaggregated / aggregated (goal <= 1.2x).
# nixl comes from the carried wheel: put nixl_cu13-*-cp312-*.whl into .whl/ (device_env.sh
# installs .whl/*.whl); without it this says so and measures nothing.
#   OUT=/tmp/out bash bench/kv_nixl_gpu_run.sh [disagg spec, default 8b:2:4:30]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m; } \
    > "$OUT/machine.txt" 2>&1
head -3 "$OUT/machine.txt"
ls .whl/nixl* >/dev/null 2>&1 || echo "NO NIXL WHEEL in .whl/ (expected nixl_cu13-*-cp312-*.whl)"
if ! python3 -c "from kvpilot.engine.kv_transfer.nixl_agent import nixl_api; \
print('nixl:', nixl_api().__name__)" 2>&1 | tee "$OUT/nixl.txt" | grep -q "^nixl:"; then
    tail -3 "$OUT/nixl.txt"
    echo "SUMMARY: nixl is not importable here: nothing measured"
    exit 1
fi
cat "$OUT/nixl.txt"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE --timeout 90 \
    tests/disagg/test_disagg_nixl.py tests/disagg/test_nixl_agent.py 2>&1 \
    | tee "$OUT/nixl-tests.log" | tail -6
timeout 100 python3 bench/kv_nixl_gpu.py --shape 8b --tokens 8192 --repeat 3 --out "$OUT" 2>&1 \
    | grep -v "NIXL INFO" | tee "$OUT/kv_nixl_gpu.log" | tail -6
if [ "${RATE_ONLY:-0}" != 1 ] && [ $SECONDS -lt 200 ]; then
    IFS=: read -r shape long decode seconds <<< "${1:-8b:2:4:30}"
    timeout $(( 410 - SECONDS )) python3 bench/disagg_gpu.py --shape "$shape" --long-rate "$long" \
        --decode-rate "$decode" --seconds "${seconds:-30}" --kv-transport nixl --out "$OUT" \
        --logs "$OUT/disagg-logs" 2>&1 | grep -v "NIXL INFO\|^wrote\|^$" \
        | tee "$OUT/disagg-nixl.log" | tail -12
else
    echo "disaggregation benchmark skipped (RATE_ONLY=1 or ${SECONDS}s already spent)"
fi
echo "SUMMARY:"
tail -1 "$OUT/nixl-tests.log"
cat "$OUT"/kv_nixl_gpu-8b.md 2>/dev/null | tail -4
grep -h "TTFT p50 disaggregated" "$OUT"/disagg_gpu-*-nixl.md 2>/dev/null
