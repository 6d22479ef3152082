#!/usr/bin/env bash
# session 15, calls 5 and 8 (1 GPU): issue 21's lines on this tree in one call: attention bench, recipe, batch-1, GPU tests
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/work; mkdir -p $W
source bench/device_env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log --oneline -1 2>/dev/null; } | tee $W/machine.txt
T0=$(date +%s)
timeout 150 python3 bench/kernels/attention_bench.py --out "$W/attention" --prefill-kernels gluon --defaults-only > "$W/attention.log" 2>&1
echo "bench exit $? at $(( $(date +%s) - T0 )) s"; grep -E "^\|" "$W/attention/attention.md" | head -24 | cut -c1-250
recipe() {  # seed tag
  local seed=$1 tag=$2
  timeout 90 python3 bench/e2e_gpu.py --only c --hf-requests 0 --seed "$seed" --out "$W/$tag" > "$W/$tag.log" 2>&1
  python3 -c "
import json; d=json.load(open('$W/$tag/e2e_gpu_c.json')); k=d['throughput']['kvpilot']
print('$tag', 'seed', d['seed'], round(k['output_tok_per_s']), k['output_tokens'], round(k['elapsed_s'],3), 'copy', round(d['copy_gbps']), 'at $(( $(date +%s) - T0 )) s')" 2>&1 | tail -1 | tee -a $W/recipe.txt
}
for r in "0 s0-cold" "0 s0-1" "7 s7-1" "0 s0-2" "7 s7-2" "0 s0-3"; do recipe $r; done
timeout 60 python3 bench/e2e_gpu.py --only d --out "$W/batch1" > "$W/batch1.log" 2>&1
echo "batch1 exit $? at $(( $(date +%s) - T0 )) s"
python3 -c "
import json; d=json.load(open('$W/batch1/e2e_gpu_d.json')); print(d['batch1'])" 2>&1 | tail -2 | cut -c1-400
left=$(( 580 - ($(date +%s) - T0) ))
timeout $left python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_prefill_attention_gluon.py tests/kernels/test_triton_backend.py tests/kernels/test_graph_inputs.py tests/kernels/test_cuda_graphs.py tests/kernels/test_qk_norm_rotary.py tests/kernels/test_small_kernels.py tests/kernels/test_gpu_bf16.py tests/kernels/test_paged_decode_attention.py > "$W/gpu-tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - T0 )) s (limit $left)"; tail -2 "$W/gpu-tests.log" | cut -c1-300; grep -E "^(FAILED|ERROR)" "$W/gpu-tests.log" | head -10 | cut -c1-300
tar -czf "$OUT/call5.tgz" -C $W .
cp $W/recipe.txt $W/machine.txt "$OUT/" 2>/dev/null
