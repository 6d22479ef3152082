#!/usr/bin/env bash
# Regenerates crds/ from the pydantic models (kvpilot.operator.api) and copies them into the
# Helm chart; tests/operator_api and tests/chart fail until this has been run and committed.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/kvpilot crds --write crds
cp crds/*.yaml charts/kvpilot/files/crds/
