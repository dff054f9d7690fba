#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow integration tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Whole modules per worker (--dist loadfile): a module's subprocess runs share its fixtures. One
# worker more than cores (at most 4): many tests wait on Slurm or on a training subprocess's next
# step, and the extra worker fills that idle time (2 cores: 444 s with 3 workers; tests/conftest.py
# also pins one OpenMP thread per process).
# `-n 0` after the script's name runs everything in this one process instead.
.venv/bin/python -m ruff check .   # lint first: seconds, and a failure names file:line
WORKERS=${WELLMIXED_TEST_WORKERS:-$(( $(nproc) + 1 < 4 ? $(nproc) + 1 : 4 ))}
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
