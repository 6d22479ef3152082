#!/usr/bin/env bash
# Call 15: whichever card comes. On an H100, call 13 (LoRA at both shapes, 8B Poisson at a
# 512-token budget); on an H200, call 14 (the 131,072-token prefill on the card the issue
# names).
set -u
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then
  bash bench/issue44/call13.sh
else
  bash bench/issue44/call14.sh
fi
