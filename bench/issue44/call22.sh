#!/usr/bin/env bash
# Call 22 (issue 44 items 3 and 4): the 0.6B shape's json_schema vs length-matched
# unconstrained requests with xgrammar's accept on one thread (as committed, "new") and as
# before (xgrammar's batch accept on the fill's 15 threads, which starts a pool of threads
# per call: `sed` below), two rounds each (engines vary from process to process); then LoRA
# 8 adapters vs base at the 8B shape (0.788 on an H100 before PDL; call 21's run of it
# timed out while Triton compiled on a cold host). ~6 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import os, torch, triton; print("torch", torch.__version__, "triton",
triton.__version__, "cpus", len(os.sched_getaffinity(0)))'; } | tee "$OUT/machine.txt"
structured() {
  echo "== $1 ($(( $(date +%s) - start )) s in)"
  timeout 240 python3 bench/structured_gpu.py "$OUT/structured-$1" --shape 0.6b --no-checks \
    --modes json_schema,unconstrained_matched --repeat 2 > "$OUT/structured-$1.log" 2>&1
  echo "exit $?"
  grep -h "^| \|^slowdown\|^ratio" "$OUT/structured-$1/results.md" | cut -c1-200
}
matchers=engine/kvpilot/engine/structured/matchers.py
cp $matchers /tmp/matchers_committed.py
structured new
sed -i 's/self\._xgrammar\.accept(/self._xgrammar.batch.batch_accept_token(/' $matchers
echo "before: $(grep -c 'self._xgrammar.batch.batch_accept_token(' $matchers) line changed"
structured before
cp /tmp/matchers_committed.py $matchers
echo "== LoRA 8B ($(( $(date +%s) - start )) s in)"
for round in 1 2; do
  timeout 200 python3 bench/lora_gpu.py "$OUT/lora-8b-$round" --shape 8b --modes base,lora8 \
    > "$OUT/lora-8b-$round.log" 2>&1
  echo "exit $?"; grep -h "^| \|^ratio" "$OUT/lora-8b-$round/results.md" | cut -c1-160
done
echo "total $(( $(date +%s) - start )) s"
