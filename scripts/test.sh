#!/usr/bin/env bash
# Command (2) of the README: set up if needed, lint, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.tools/bin:$PATH"
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
