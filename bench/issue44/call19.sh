#!/usr/bin/env bash
# Call 19 (issue 44 item 4), prepared after call 17: xgrammar's rows on the engine's own
# persistent threads (fill and accept), where xgrammar's BatchGrammarMatcher started a new
# pool per call; LoRA's expand reading only a merged seam's own rank columns. In order: the
# GPU tests of both (LoRA kernel and engine, structured outputs); the pool probe (batch vs
# persistent per-row fills); the LoRA kernel per layer, padded vs parts; the 0.6B shape's
# json_schema vs length-matched requests; LoRA 8 adapters vs base at both shapes; a server
# at budget 2048 checked for "first use after ready" (the warm-up's mixed step, not yet
# seen on a GPU). Writes $OUT/. ~9 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
source bench/issue44/optional_wheels.sh
start=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import os, torch, triton; print("torch", torch.__version__, "triton",
triton.__version__, "cpus", len(os.sched_getaffinity(0)))'; } | tee "$OUT/machine.txt"
mkdir -p "$OUT/tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_sgmv.py \
  tests/lora/test_lora_gpu.py tests/core/test_structured_gpu.py \
  tests/core/test_structured_xgrammar.py 2>&1 | tail -8 | tee "$OUT/tests/gpu-tests.log"
echo "== probe ($(( $(date +%s) - start )) s in)"
(cd bench && timeout 90 python3 xgrammar_pool_probe.py --threads 1,4,8,15 --steps 80) 2>&1 \
  | grep -v Warning | tee "$OUT/pool_probe.json"
echo "== lora kernel ($(( $(date +%s) - start )) s in)"
timeout 90 python3 bench/kernels/lora_sgmv_gpu.py 2>&1 | tee "$OUT/lora_kernel.jsonl"
echo "== engines ($(( $(date +%s) - start )) s in)"
ONLY=structured-0.6b,lora-8b,lora-0.6b bash bench/issue44/structured_lora.sh
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
