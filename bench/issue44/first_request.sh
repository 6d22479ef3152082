#!/usr/bin/env bash
# Issue 44: where the first request after ready spends its time (slow-step log), 0.6B shape.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/opentelemetry*.whl 2>&1 | tail -1
python3 - <<'PY' 2>&1 | tail -30
import json, os, sys, time, tempfile, subprocess, httpx
sys.path.insert(0, "bench")
from pathlib import Path
from e2e_gpu import QWEN3_0_6B, model_dir
tmp = Path(tempfile.mkdtemp()); path = model_dir(tmp, "m", QWEN3_0_6B)
log = open(os.environ["OUT"] + "/serve.log", "wb")
env = dict(os.environ, KVPILOT_SLOW_STEP_MS="40")
p = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "serve", str(path), "--load-format", "dummy",
    "--max-model-len", "4096", "--max-num-batched-tokens", "512", "--port", "8123", "--served-model-name", "m", "--api-server-count", "2"],
    stdout=log, stderr=subprocess.STDOUT, env=env)
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8123/ready", timeout=1).status_code == 200: break
    except Exception: pass
    time.sleep(0.3)
for n in (964, 519, 964):
    t = time.perf_counter()
    r = httpx.post("http://127.0.0.1:8123/v1/completions", json={"model": "m", "prompt": " ".join(f"t{i%1000}" for i in range(n)), "max_tokens": 1}, timeout=60)
    print(n, r.status_code, f"{(time.perf_counter()-t)*1e3:.1f} ms")
p.terminate(); p.wait(30)
PY
grep -E "slow|warm-up|CUDA graphs|ready" "$OUT/serve.log" | cut -c1-400
