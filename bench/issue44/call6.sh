#!/usr/bin/env bash
# Issue 44, the serving half of call 5 (whose API servers lacked the opentelemetry-api wheel
# that fastapi 0.165 imports): Poisson at 50% and 80% of saturation, 0.6B piecewise on and
# off, 8B on.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/opentelemetry*.whl 2>&1 | tail -1
timeout 230 python3 bench/poisson_gpu.py --out "$OUT/poisson06" --shapes 0.6b --modes on,off \
  --requests 200 > "$OUT/poisson06.log" 2>&1; tail -14 "$OUT/poisson06.log"
timeout 140 python3 bench/poisson_gpu.py --out "$OUT/poisson8b" --shapes 8b --modes on \
  --requests 200 > "$OUT/poisson8b.log" 2>&1; tail -8 "$OUT/poisson8b.log"
