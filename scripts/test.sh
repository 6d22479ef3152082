#!/usr/bin/env bash
# Command (2) of the README: set up if needed, lint, type-check, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.tools/bin:$PATH"
.venv/bin/ruff check .
.venv/bin/pyright   # operator/, engine/, kernels/, cli/ and the typed test fakes: 0 errors
set +e
# Two pytest-xdist workers, each test file whole on one worker (its module and session
# fixtures built once): most tests wait on subprocesses or sockets, so a 2-core machine
# runs two files at a time in about half the wall time. `-n 0` among the arguments runs
# everything in this one process.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
