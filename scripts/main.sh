#!/usr/bin/env bash
# Command (1) of the README: set up if needed, start a local fleet on the bundled
# tiny model, send it one OpenAI chat request, print the answer and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvpilot up examples/tiny-cpu.yaml --once "$@"
