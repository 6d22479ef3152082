#!/usr/bin/env bash
# c) and d) before/after on one GPU call, same machine: the working tree ("new") against an older
# engine ("base") extracted beforehand with
#   mkdir -p build/kvp_base && git archive <REV> engine kernels cli operator | tar -x -C build/kvp_base
# and carried to the device (build/ is git-ignored: run with carry ["build/kvp_base",
# "build/e2e_gpu_ab.sh"] or copy this script there). Order new, base, base, new (ABBA) so Triton's
# warm cache favours neither side. Results: $OUT/summary.txt, $OUT/gpu_runs.json, $OUT/gpu_log.txt.
#   OUT=/tmp/out bash bench/e2e_gpu_ab.sh      # about 3 minutes on one H100
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
mkdir -p /tmp/kvp/kvpilot /tmp/kvb/kvpilot /tmp/res
for d in operator engine kernels cli; do ln -sfn $PWD/$d /tmp/kvp/kvpilot/$d; ln -sfn $PWD/build/kvp_base/$d /tmp/kvb/kvpilot/$d; done
LOG=$OUT/gpu_log.txt
PYTHONPATH=/tmp/kvp timeout 150 python3 -m pytest -q -p no:cacheprovider tests/core/test_gpu_engine.py tests/kernels/test_cuda_graphs.py 2>&1 | tail -15 | tee -a $LOG
run() { # name pythonpath only
  [ $SECONDS -lt 440 ] || { echo "$1 skipped (time)" | tee -a $LOG; return; }
  # --phases for the summary's execute split, --profile for profile_d.txt
  PYTHONPATH=$2 timeout 170 python3 bench/e2e_gpu.py --only $3 --hf-requests 0 --phases --profile \
    --out /tmp/res/$1 >> $LOG 2>&1
  echo "$1 rc=$? $(date +%T)" | tee -a $LOG
}
run c_new1 /tmp/kvp c; run c_base1 /tmp/kvb c; run d_new1 /tmp/kvp d; run d_base1 /tmp/kvb d
run d_base2 /tmp/kvb d; run d_new2 /tmp/kvp d; run c_base2 /tmp/kvb c; run c_new2 /tmp/kvp c
python3 - <<'PY' | tee $OUT/summary.txt
import json, glob, os
out = {}
for f in sorted(glob.glob("/tmp/res/*/e2e_gpu_*.json")):
    name = f.split("/")[3]; r = json.load(open(f)); out[name] = r
    if "throughput" in r:
        k = r["throughput"]["kvpilot"]; p = k["phases_s"]
        print(name, r["gpu"], f"{k['output_tok_per_s']:.0f} tok/s elapsed {k['elapsed_s']:.2f} execute {p['execute']:.2f} build {p.get('build_batch',0):.2f} replay {p.get('graph_replay',0):.2f} lm_head {p.get('lm_head',0):.2f} eager {p.get('eager_forward',0):.2f}")
    else:
        d = r["batch1"]
        print(name, r["gpu"], f"{d['engine_ms_per_token']:.3f} ms/token of_roofline {d['engine_of_roofline']:.3f} replay {d['graph_replay_ms']:.3f} roofline {d['roofline_ms']:.3f}")
json.dump(out, open(os.environ["OUT"] + "/gpu_runs.json", "w"), indent=1)
PY
cp /tmp/res/d_new1/profile_d.txt $OUT/profile_d_new.txt 2>/dev/null; cp /tmp/res/d_base1/profile_d.txt $OUT/profile_d_base.txt 2>/dev/null
