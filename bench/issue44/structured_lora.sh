#!/usr/bin/env bash
# Issue 44 item 4 on one GPU, one call (<= 8 min; a cold host's first engines compile Triton's
# kernels, which is why the 0.6B parts' limits are wide): structured outputs (json_schema) at batch 64
# against unconstrained requests ending at the same lengths, and 8 LoRA adapters against the
# base model, at the Qwen3-0.6B and Llama-3-8B shapes (dummy weights), each ratio from engines
# of this call. json_schema runs the default backend (auto: xgrammar for this schema) and,
# beside it, llguidance (json_schema_guidance, `--structured-outputs-backend guidance`).
# Writes $OUT/<part>/results.{json,md},
# $OUT/logs.txt and $OUT/summary.md.
#
#     bash bench/issue44/structured_lora.sh                    # the GPU host, after carrying .whl/
#     KVPILOT_BENCH_SMOKE=1 bash bench/issue44/structured_lora.sh   # CPU, tiny models, ~1 min
#     ONLY=structured-0.6b,lora-0.6b bash bench/issue44/structured_lora.sh   # some parts only
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${KVPILOT_BENCH_SMOKE:-0}" = 1 ]; then
  smoke=(--smoke); scale=4  # the CPU smoke run: timeouts for a loaded 2-core box
  export PYTHONPATH="$PWD/operator:$PWD/engine:$PWD/engine/torch_free:$PWD/kernels:$PWD/cli${PYTHONPATH:+:$PYTHONPATH}"
  PY=${PYTHON:-python3}
else
  smoke=(); scale=1
  source bench/device_env.sh
  PY=python3
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c 'import os, torch, triton; print("torch", torch.__version__, "triton",
triton.__version__, "cpus", len(os.sched_getaffinity(0)))'; } | tee "$OUT/machine.txt"
fi
start=$(date +%s)
# name, time limit (s), command: each ratio's engines run in one child of this call, in turn
run() {
  local name=$1 limit=$2; shift 2
  case ",${ONLY:-$name}," in *",$name,"*) ;; *) return ;; esac
  echo "== $name ($(( $(date +%s) - start )) s in): $*" | tee -a "$OUT/logs.txt"
  timeout $(( limit * scale )) "$PY" "$@" "${smoke[@]}" >> "$OUT/logs.txt" 2>&1
  echo "   exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/logs.txt"
  grep -h "^| \|^ratio\|^slowdown" "$OUT/$name/results.md" 2>/dev/null | cut -c1-160
}
run structured-0.6b 240 bench/structured_gpu.py "$OUT/structured-0.6b" --shape 0.6b --no-checks \
  --modes json_schema,unconstrained_matched,json_schema_guidance
run lora-0.6b 120 bench/lora_gpu.py "$OUT/lora-0.6b" --shape 0.6b --modes base,lora8
run structured-8b 90 bench/structured_gpu.py "$OUT/structured-8b" --shape 8b --no-checks \
  --modes json_schema,unconstrained_matched,json_schema_guidance
run lora-8b 55 bench/lora_gpu.py "$OUT/lora-8b" --shape 8b --modes base,lora8

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def read(name):
    path = out / name / "results.json"
    return json.loads(path.read_text()) if path.exists() else None


def fmt(value, spec=".3f"):
    return "missing" if value is None else format(value, spec)


lines = ["| shape | structured: matched tok/s / json_schema (goal <= 1.10) | the same with "
         "llguidance | decode step ms json / matched | LoRA: lora8 / base tok/s (goal >= 0.80) "
         "| decode step ms lora8 / base |", "|---|---|---|---|---|---|"]
for shape in ("0.6b", "8b"):
    s, lo = read(f"structured-{shape}"), read(f"lora-{shape}")
    rows = {r["mode"]: r for r in (s or {}).get("rows", [])}
    lrows = {r["mode"]: r for r in (lo or {}).get("rows", [])}
    step = lambda rows, m: (rows.get(m) or {}).get("decode_step_ms_median")  # noqa: E731
    lines.append(
        f"| {shape} | {fmt((s or {}).get('slowdown_tok_per_s_matched'))} | "
        f"{fmt((s or {}).get('slowdown_guidance_tok_per_s_matched'))} | "
        f"{fmt(step(rows, 'json_schema'), '.2f')} / {fmt(step(rows, 'unconstrained_matched'), '.2f')} | "
        f"{fmt((lo or {}).get('ratio_tok_per_s'))} | "
        f"{fmt(step(lrows, 'lora8'), '.2f')} / {fmt(step(lrows, 'base'), '.2f')} |")
print("\n".join(lines))
PYEOF
echo "total $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
