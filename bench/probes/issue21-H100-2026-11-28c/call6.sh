#!/usr/bin/env bash
# session 15, call 6 (1 GPU): the decode prologue's GPU tests, then the recipe A/B against 9237311 in fresh processes
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/work; mkdir -p $W
source bench/device_env.sh
mkdir -p /tmp/base && tar -xzf calls/base2.tgz -C /tmp/base
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $W/machine.txt
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_paged_decode_attention.py tests/kernels/test_triton_backend.py tests/kernels/test_qk_norm_rotary.py tests/kernels/test_cuda_graphs.py tests/kernels/test_gpu_bf16.py > "$W/gpu-tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s"; tail -1 "$W/gpu-tests.log" | cut -c1-300; grep -E "^(FAILED|ERROR)" "$W/gpu-tests.log" | head -10 | cut -c1-300
recipe() {  # tree seed tag
  local tree=$1 seed=$2 tag=$3
  if [ "$tree" = base ]; then
    (cd /tmp/base && PYTHONPATH=/tmp/base/operator:/tmp/base/engine:/tmp/base/kernels:/tmp/base/cli:/tmp/site timeout 90 python3 bench/e2e_gpu.py --only c --hf-requests 0 --seed "$seed" --out "$W/$tag" > "$W/$tag.log" 2>&1)
  else
    timeout 90 python3 bench/e2e_gpu.py --only c --hf-requests 0 --seed "$seed" --out "$W/$tag" > "$W/$tag.log" 2>&1
  fi
  python3 -c "
import json; d=json.load(open('$W/$tag/e2e_gpu_c.json')); k=d['throughput']['kvpilot']
print('$tag', 'seed', d['seed'], round(k['output_tok_per_s']), k['output_tokens'], round(k['elapsed_s'],3), 'at $(( $(date +%s) - T0 )) s')" 2>&1 | tail -1 | tee -a $W/recipe.txt
}
for r in "base 0 base-s0-cold" "new 0 new-s0-cold" "new 0 new-s0-1" "base 0 base-s0-1" "base 0 base-s0-2" "new 0 new-s0-2" "new 7 new-s7-1" "base 7 base-s7-1" "new 0 new-s0-3" "base 0 base-s0-3"; do
  [ $(( $(date +%s) - T0 )) -lt 520 ] && recipe $r
done
tar -czf "$OUT/call6.tgz" -C $W .
cp $W/recipe.txt "$OUT/" 2>/dev/null
