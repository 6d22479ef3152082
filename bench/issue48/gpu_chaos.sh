#!/usr/bin/env bash
# Issue 48 on one GPU, one call (<= 4 min wall; carry .whl): chaos with migration under
# `kvpilot up` (bench/chaos_migration.py). Run A: 3 replicas of a Qwen3-0.6B-shaped random
# bf16 checkpoint (bundled tiny tokenizer) on the one GPU, 8 GiB of KV each, 12 streaming
# workers for 50 s while a replica is SIGKILLed every 8 s (kvpilot up restarts it) and
# another SIGSTOPped 6-9 s at a time; greedy and seeded streams compared with an undisturbed
# run; then a drain: 3 -> 2 replicas (SIGHUP) with 12 greedy 3000-token streams in flight.
# Run B, only with the time left: the CPU acceptance's fleet (dummy:tiny-llama, float32) on
# the GPU. Engines start with their default warm-up (CUDA graphs included): each restart of
# a killed replica is part of the chaos.
#
#   OUT=/tmp/out bash bench/issue48/gpu_chaos.sh                    # the GPU machine
#   CHAOS_DEVICE=cpu PYTHON=.venv/bin/python bash bench/issue48/gpu_chaos.sh   # smoke test
#
# Comes back under $OUT (8 files): NOTES.md (the runs' NOTES-ready summaries and the
# machine), run.log (this console), and per run summary-R.json, router-R.log (the moves),
# fleet-R.log (kvpilot up's log, the engines' logs, the manifest).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEVICE=${CHAOS_DEVICE:-cuda}
BUDGET=${CHAOS_BUDGET_S:-225}  # seconds this script may take, start-up to the last copy
source bench/device_env.sh
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/chaos48-XXXXXX)
exec > >(tee "$OUT/run.log") 2>&1
if [ "$DEVICE" = cuda ]; then
  A=(--device cuda --shape 0.6b --dtype bfloat16 --kv-cache-memory 8GiB --max-model-len 4096
     --max-num-seqs 64 --max-num-batched-tokens 2048 --max-tokens 384 --workers 12
     --reference-concurrency 12 --seconds 50 --drain-streams 12 --drain-tokens 3000)
  B=(--device cuda --shape tiny --max-tokens 96 --workers 6 --reference-concurrency 6)
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  } | tee "$OUT/NOTES.md"
else  # the same command lines on this box's CPU, tiny model, short
  A=(--device cpu --shape tiny --dtype float32 --kv-cache-memory 256MiB --max-model-len 2048
     --max-num-seqs 16 --max-num-batched-tokens 512 --max-tokens 24 --workers 4
     --reference-concurrency 4 --seconds 20 --drain-streams 4 --drain-tokens 600)
  B=(--device cpu --shape tiny --max-tokens 24 --workers 3 --reference-concurrency 3)
  echo "CPU smoke test of bench/issue48/gpu_chaos.sh ($(nproc) cores)" | tee "$OUT/NOTES.md"
fi

run() {  # NAME LIMIT_S ARGS...: one chaos run, its files copied under $OUT
  local name=$1 limit=$2; shift 2
  echo "== run $name (limit ${limit}s): chaos_migration.py $*"
  timeout -k 20 "$limit" "$PY" bench/chaos_migration.py --out "$WORK/$name" \
    --model-root "$WORK" "$@" > "$WORK/$name.out" 2>&1
  local rc=$?
  tail -n 60 "$WORK/$name.out"
  echo "== run $name: exit $rc after ${SECONDS}s of the script"
  cp "$WORK/$name/summary.json" "$OUT/summary-$name.json" 2>/dev/null
  cp "$WORK/$name"/logs/*-router.log "$OUT/router-$name.log" 2>/dev/null
  for f in "$WORK/$name/fleet.yaml" "$WORK/$name"/logs/*.log; do
    case $f in *-router.log) continue ;; esac
    [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; }
  done > "$OUT/fleet-$name.log"
  { echo; echo "## Run $name (exit $rc)"; echo
    cat "$WORK/$name/summary.md" 2>/dev/null || { echo "no summary; the run's last lines:"
      echo '```'; tail -n 20 "$WORK/$name.out"; echo '```'; }; } >> "$OUT/NOTES.md"
  rm -rf "$WORK/qwen3-0.6b-shape"  # the checkpoint (0.9 GB) stays out of $OUT
}

run A $((BUDGET - SECONDS - 10)) "${A[@]}"
LEFT=$((BUDGET - SECONDS))
if [ "$LEFT" -ge 80 ]; then  # at most 60 s of chaos: longer, kvpilot up's restart back-off
  # (doubling to 30 s for a replica killed again within a minute) outruns --hold-timeout
  run B $((LEFT - 5)) "${B[@]}" --seconds $((LEFT - 55 < 60 ? LEFT - 55 : 60))
else
  echo "== run B skipped: ${LEFT}s of the ${BUDGET}s budget left" | tee -a "$OUT/NOTES.md"
fi
echo "== done in ${SECONDS}s"; cat "$OUT/NOTES.md"
