#!/usr/bin/env bash
# Call 21 (issue 44 item 4): xgrammar's mask fill on a pool of threads made once, each
# taking the next row (`XgrammarMatchers.fill`), and its accept on one thread, instead of
# xgrammar's batch calls, which start and join a pool of 15 threads per call. In order: the
# structured-output GPU tests; `bench/xgrammar_pool_probe.py` (the fill alone, batch vs pool
# per thread count, and the accept); the 0.6B shape's json_schema vs length-matched
# unconstrained requests with the fill as committed ("new"), as before ("before", made by
# `call21_variants.py before`), with fixed shares per thread ("chunked"), and as committed
# again (engines vary from process to process); then, on an H100, LoRA 8 adapters vs base
# at the 8B shape (0.788 there before PDL). ~8 min. Ran on commit db365ce, whose pool fill
# was slower inside the engine and was reverted after this call (its accept on one thread
# kept): run it from that commit (`git checkout db365ce`), which `call21_variants.py` edits.
source bench/issue44/call_start.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/core/test_structured_gpu.py \
  tests/core/test_structured_xgrammar.py 2>&1 | tail -4 | tee "$OUT/gpu-tests.log"
echo "== probe ($(( $(date +%s) - start )) s in)"
(cd bench && timeout 120 python3 xgrammar_pool_probe.py --threads 1,4,8,15 --steps 40) 2>&1 \
  | grep -v Warning | tee "$OUT/probe.json"
structured() {  # variant: json_schema then unconstrained_matched, each in a fresh process
  echo "== $1 ($(( $(date +%s) - start )) s in)"
  timeout 200 python3 bench/structured_gpu.py "$OUT/structured-$1" --shape 0.6b --no-checks \
    --modes json_schema,unconstrained_matched > "$OUT/structured-$1.log" 2>&1
  echo "exit $?"
  grep -h "^| \|^slowdown\|^ratio" "$OUT/structured-$1/results.md" | cut -c1-200
}
files="engine/kvpilot/engine/structured/matchers.py engine/kvpilot/engine/structured/xgrammar_backend.py"
mkdir -p /tmp/committed && cp $files /tmp/committed/
structured new
python3 bench/issue44/call21_variants.py before && structured before
cp /tmp/committed/*.py engine/kvpilot/engine/structured/
python3 bench/issue44/call21_variants.py chunked && structured chunked
cp /tmp/committed/*.py engine/kvpilot/engine/structured/
structured new2
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
  echo "== LoRA 8B ($(( $(date +%s) - start )) s in)"
  mkdir -p "$OUT/lora" && OUT="$OUT/lora" ONLY=lora-8b bash bench/issue44/structured_lora.sh
fi
echo "total $(( $(date +%s) - start )) s"
