#!/usr/bin/env bash
# Call 20 (issue 44 items 3 and 4), prepared after the short call of 2026-12-06: LoRA's two
# kernels launched with PDL (each waits for the kernel before it first thing, so a launch
# overlaps the previous grid's drain; eight such kernels a layer in a decode step). In order:
# the GPU tests of LoRA and structured outputs; the LoRA kernels per layer with PDL and
# without (KVPILOT_PDL=0, every kernel's PDL off); LoRA 8 adapters vs base at the 8B shape
# with the kernels as committed and as before (a copy with PDL=False passed at both launches),
# then at 0.6B; the 0.6B shape's json_schema (xgrammar) at 4 and 8 fill threads beside the
# default (CPUs - 1) and length-matched unconstrained requests (call 18's question, not run:
# does the fill lose to the engine's other threads on 15?); a server at budget 2048 checked
# for "first use after ready" (the warm-up's mixed step, not yet seen on a GPU). ~7 min.
source bench/issue44/call_start.sh
mkdir -p "$OUT/tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_sgmv.py \
  tests/lora/test_lora_gpu.py tests/core/test_structured_gpu.py \
  tests/core/test_structured_xgrammar.py 2>&1 | tail -8 | tee "$OUT/tests/gpu-tests.log"
echo "== lora kernel, PDL on then off ($(( $(date +%s) - start )) s in)"
timeout 90 python3 bench/kernels/lora_sgmv_gpu.py 2>&1 | sed 's/^/pdl-on /' | tee "$OUT/lora_kernel.jsonl"
KVPILOT_PDL=0 timeout 90 python3 bench/kernels/lora_sgmv_gpu.py 2>&1 | sed 's/^/pdl-off /' \
  | tee -a "$OUT/lora_kernel.jsonl"
echo "== LoRA engines ($(( $(date +%s) - start )) s in)"
ONLY=lora-8b bash bench/issue44/structured_lora.sh
kernel=kernels/kvpilot/kernels/lora_sgmv.py
cp $kernel /tmp/lora_sgmv_committed.py
sed -i 's/^    pdl = pdl_args(x)$/    pdl = {"PDL": False}/' $kernel
echo "before (no PDL at LoRA's launches): $(grep -c 'pdl = {"PDL": False}' $kernel) line changed"
mkdir -p "$OUT/before"
OUT="$OUT/before" ONLY=lora-8b bash bench/issue44/structured_lora.sh
cp /tmp/lora_sgmv_committed.py $kernel
ONLY=lora-0.6b bash bench/issue44/structured_lora.sh
echo "== 0.6B json_schema by fill threads ($(( $(date +%s) - start )) s in)"
timeout 300 python3 bench/structured_gpu.py "$OUT/structured-0.6b-threads" --shape 0.6b \
  --no-checks --modes json_schema,unconstrained_matched --fill-threads 4,8 \
  > "$OUT/structured-threads-logs.txt" 2>&1
echo "exit $?"
grep -h "^| \|^slowdown\|^ratio" "$OUT/structured-0.6b-threads/results.md" | cut -c1-200
echo "== first use after ready ($(( $(date +%s) - start )) s in)"
timeout 100 python3 - <<'PY' 2>&1 | tail -8
import os, subprocess, sys, tempfile, time
from pathlib import Path
import httpx
sys.path.insert(0, "bench")
from e2e_gpu import QWEN3_0_6B, model_dir
path = model_dir(Path(tempfile.mkdtemp()), "m", QWEN3_0_6B)
log = open(os.environ["OUT"] + "/serve-2048.log", "wb")
p = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", str(path), "--load-format",
    "dummy", "--max-model-len", "4096", "--max-num-batched-tokens", "2048", "--port", "8123",
    "--served-model-name", "m"], stdout=log, stderr=subprocess.STDOUT)
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8123/ready", timeout=1).status_code == 200: break
    except Exception: pass
    time.sleep(0.3)
prompt = lambda n: " ".join(f"t{i % 1000}" for i in range(n))
def post(n, tokens):
    t = time.perf_counter()
    r = httpx.post("http://127.0.0.1:8123/v1/completions", json={"model": "m", "prompt": prompt(n),
                   "max_tokens": tokens, "ignore_eos": True}, timeout=60)
    return r.status_code, round((time.perf_counter() - t) * 1e3, 1)
print("first 960-token request", post(960, 1), "again", post(960, 1))
import concurrent.futures as cf
with cf.ThreadPoolExecutor(8) as pool:  # decodes running while prompts arrive: mixed steps
    print("mixed", list(pool.map(lambda i: post(100 + 300 * (i % 4), 64), range(16))))
p.terminate(); p.wait(30)
PY
grep -E "first use after ready|warm-up|ready in" "$OUT/serve-2048.log" | cut -c1-300
echo "total $(( $(date +%s) - start )) s"
