#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow integration tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Whole modules per worker (--dist loadfile): a module's subprocess runs share its fixtures. With 2
# cores, 2 workers: most tests wait on a training subprocess that leaves a core idle. `-n 0` after
# the script's name runs everything in this one process instead.
WORKERS=${WELLMIXED_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
