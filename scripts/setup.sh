#!/usr/bin/env bash
# Set up .venv with wellmixed and its dev extra, on a machine with only Python 3.11 and pip.
# torch:
# - already installed in .venv (a cluster's own build, a GPU image's CUDA build) at or above the floor in
#   pyproject.toml: kept as it is, never reinstalled;
# - installed but older than the floor: refused (one line naming both versions), nothing installed;
# - none: torch==2.13.0 is installed -- the CPU wheel when no NVIDIA GPU is present (never a CUDA build
#   on a CPU machine), the default PyPI wheel (CUDA) when `nvidia-smi` sees a GPU.
# After every install the torch build is checked: a dependency that swapped it is an error.
#   bash scripts/setup.sh                    # set up
#   bash scripts/setup.sh --decide 2.11.0    # print what would happen to an installed torch 2.11.0
#                                            # (keep / install / refuse); '' = none installed
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=2.13.0
FLOOR=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$FLOOR" ] || { echo "setup: no \"torch>=X\" line in pyproject.toml" >&2; exit 2; }

# keep | install | refuse, for an installed torch version ($1, '' when none) against the floor
torch_decision() {
  local v=${1%%+*}  # 2.11.0+cu130 -> 2.11.0
  if [ -z "$v" ]; then echo install; return; fi
  if [ "$(printf '%s\n%s\n' "$FLOOR" "$v" | sort -V | head -n1)" = "$FLOOR" ]; then echo keep; else echo refuse; fi
}

if [ "${1:-}" = "--decide" ]; then
  torch_decision "${2:-}"
  exit 0
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PY=.venv/bin/python
PIP="$PY -m pip"
torch_version() { $PY -c "import torch; print(torch.__version__)" 2>/dev/null || true; }

BEFORE=$(torch_version)
case "$(torch_decision "$BEFORE")" in
  refuse)
    echo "setup: .venv has torch $BEFORE, older than the floor $FLOOR in pyproject.toml; upgrade it" \
         "(or remove it and rerun: torch==$PIN is installed then)" >&2
    exit 2 ;;
  keep)
    echo "setup: keeping the installed torch $BEFORE (>= $FLOOR)"
    EXPECT=$BEFORE ;;
  install)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      $PIP install -q "torch==$PIN"
    else
      # A local CPU wheel if pip's configured find-links has one, else the official CPU index.
      $PIP install -q --no-deps --no-index "torch==$PIN" 2>/dev/null \
        || $PIP install -q --no-deps "torch==$PIN" --index-url https://download.pytorch.org/whl/cpu
      # torch's own pure-Python dependencies (the CPU wheel above came without them; torch stays)
      $PIP install -q "torch==$PIN"
    fi
    EXPECT=$(torch_version)
    case "$EXPECT" in
      "$PIN"|"$PIN"+*) ;;
      *) echo "setup: installing torch==$PIN gave '${EXPECT:-no torch}'" >&2; exit 1 ;;
    esac ;;
esac
# The installed torch satisfies pyproject's range: this adds the project and its other dependencies only.
$PIP install -q -e ".[dev]"
# A dependency that wants another torch would have swapped in another build: refuse that here.
AFTER=$(torch_version)
if [ "$AFTER" != "$EXPECT" ]; then
  echo "setup: torch $AFTER was installed by a dependency (expected $EXPECT); check the extras" >&2
  exit 1
fi
echo "setup: done (torch $AFTER)"
