#!/usr/bin/env bash
# Issue 17's ITL tail on one GPU host, in one device call (~5 min): first the delivery path
# alone on this host's CPUs (bench/delivery_path.py: 256 streams x 200 tokens behind a core
# stepping every 10 ms, 1 and 2 API servers: no GPU, no noise from other users), then the
# acceptance run bench/serve_vs_offline.py (offline vs served at rate inf per API server
# count, Poisson, batch 1; each phase a fresh process).
#   OUT=/tmp/out bash bench/itl_gpu_run.sh [serve_vs_offline args, default --api-server-counts 1,2;
#   1,2,4 adds a minute and may not fit the 7 minutes]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
for n in 1 2; do
    timeout 90 python3 bench/delivery_path.py --out "$OUT/delivery-$n" --streams 256 \
        --tokens 200 --period-ms 10 --api-server-count "$n" --clients 4 2>&1 \
        | tee "$OUT/delivery-$n.log" | tail -1
done
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--api-server-counts 1,2)
timeout 360 python3 bench/serve_vs_offline.py --out "$OUT/serve_vs_offline" --clients 4 \
    "${args[@]}" 2>&1 | tee "$OUT/serve_vs_offline.log" | tail -14
echo "summary:"; head -3 "$OUT/delivery-1.log" | tail -2; tail -qn1 "$OUT"/delivery-*.log
grep -E "^\| (offline|served)" "$OUT/serve_vs_offline/serve_vs_offline.md"
