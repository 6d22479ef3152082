#!/usr/bin/env bash
# Issue 6's GPU benchmark in one device call on a 2-GPU host: the disagg GPU tests, then
# bench/disagg_gpu.py for each shape:long-rate:decode-rate given (default below). Server dependencies come from wheels in .whl/
# (pip download --only-binary=:all: --python-version 3.12 fastapi uvicorn ... -d .whl) when the
# machine has no index. Results land in $OUT.
#   OUT=/tmp/out bash bench/disagg_gpu_run.sh [8b:2:4 ...]   # about 6 minutes on 2x H200
# A spec may end in :SECONDS of load (default 30). REPEAT=N runs both setups N times per spec,
# alternating (the p99 ratio varies run to run); KVPILOT_SLOW_STEP_MS=12 adds $OUT/slow.txt.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/kvp/kvpilot /tmp/site
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee "$OUT/log.txt"
for d in operator engine kernels cli; do ln -sfn "$PWD/$d" /tmp/kvp/kvpilot/$d; done
python3 -c "import fastapi, uvicorn" 2>/dev/null || \
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl/extra/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/kvp:/tmp/site
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/disagg 2>&1 | tail -4 \
  | tee -a "$OUT/log.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_small_kernels.py \
  -k checksum 2>&1 | tail -2 | tee -a "$OUT/log.txt"
for shape in 1b 8b; do timeout 60 python3 bench/kv_transfer_rate.py --shape $shape --repeat 2 2>&1 \
  | grep MB/s | tee -a "$OUT/log.txt"; done
run() { # shape long_rate decode_rate seconds
  [ $SECONDS -lt 480 ] || { echo "$1 $2 skipped (time)" | tee -a "$OUT/log.txt"; return; }
  # one run of both setups takes about twice the load time plus start-ups (80 s at 30 s of load)
  local limit=$(( ${REPEAT:-1} * (2 * $4 + 100) + 60 ))
  timeout $limit python3 bench/disagg_gpu.py --shape "$1" --long-rate "$2" --decode-rate "$3" \
    --seconds "$4" --repeat "${REPEAT:-1}" --out "$OUT/$1-long$2" --logs "/tmp/logs/$1-long$2" \
    2>&1 | grep -v "^wrote\|^$" | tail -60 \
    | tee -a "$OUT/log.txt"
  # with KVPILOT_SLOW_STEP_MS set, where the slow engine iterations went (bench/slow_steps.py)
  python3 bench/slow_steps.py /tmp/logs/$1-long$2/*/*.log 2>&1 | cut -c1-400 >> "$OUT/slow.txt"
}
# shape:long prompts/s:decodes/s[:seconds, default 30], default the configurations of
# bench/results/disagg_gpu-2xH200-*
for spec in ${*:-8b:2:4 8b:3:4 1b:3:8}; do
  IFS=: read -r shape long decode seconds <<< "$spec"; run "$shape" "$long" "$decode" "${seconds:-30}"
done
