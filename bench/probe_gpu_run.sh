#!/usr/bin/env bash
# One 2-GPU device call that measures before building (issues 16, 21, 22, 23): the NIXL
# probe (READ vs WRITE, one vs many descriptors, both GPUs visible vs one per process),
# batch-1 step profiles at TP=1/TP=2 (bf16) and TP=1 int8, and the host-tier restore.
#   OUT=/tmp/out bash bench/probe_gpu_run.sh
set -u
OUT=${OUT:-/tmp/out}
W=$OUT/work
mkdir -p "$W"
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m; } > "$W/machine.txt" 2>&1
head -3 "$W/machine.txt"
for vis in both split; do
    UCX_PROTO_INFO=y timeout 120 python3 bench/nixl_probe_gpu.py --visible $vis --mib 256 \
        > "$W/nixl-probe-$vis.log" 2>&1
    grep -E "GB/s|Error|error" "$W/nixl-probe-$vis.log" | grep -v "NIXL INFO" | head -8
done
timeout 300 python3 bench/step_profile_gpu.py "$W" --tp 1,2 --steps 32 2>&1 | tee "$W/profile.log"
timeout 150 python3 bench/step_profile_gpu.py "$W" --tp 1 --steps 32 --quantization int8 2>&1 \
    | tee "$W/profile-int8.log"
timeout 150 python3 bench/kv_tier_gpu.py --shape 8b --tokens 4096 --repeat 5 --out "$W" 2>&1 \
    | tail -5 | tee "$W/kv_tier.log"
tar czf "$OUT/probe.tgz" -C "$OUT" work
ls -la "$OUT"
