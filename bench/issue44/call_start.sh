# Sourced first by the issue 44 call scripts on a lent GPU host: $OUT made, the carried
# wheels installed (bench/device_env.sh, optional_wheels.sh), `start` set for the scripts'
# "s in" stamps, and the GPU, driver, torch, Triton and CPU count written to $OUT/machine.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import os, torch, triton; print("torch", torch.__version__, "triton",
triton.__version__, "cpus", len(os.sched_getaffinity(0)))'; } | tee "$OUT/machine.txt"
