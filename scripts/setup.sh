#!/usr/bin/env bash
# Set up .venv with wellmixed and its dev extra, on a machine with only Python 3.11 and pip.
# torch: the CPU wheel (torch==2.13.0, CPU build) when no NVIDIA GPU is present -- never a CUDA build
# on a CPU machine; the default PyPI wheel (CUDA) when `nvidia-smi` sees a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
TORCH=torch==2.13.0
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q "$TORCH"
  else
    # A local CPU wheel if pip's configured find-links has one, else the official CPU index.
    $PIP install -q --no-deps --no-index "$TORCH" 2>/dev/null \
      || $PIP install -q --no-deps "$TORCH" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# torch==2.13.0 is now satisfied by the installed build: this adds only its pure-Python deps.
$PIP install -q "$TORCH" -e ".[dev]"
# A dependency that wants another torch would have swapped in a (CUDA) build: refuse that here.
.venv/bin/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else \
  f'setup: torch {v} was installed by a dependency (expected 2.13.0); check the extras')"
