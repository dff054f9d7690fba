"""The GPU check: the real training path and the GPU-only code paths, measured in one call (< 9 minutes).

    bash scripts/gpu_check.sh                                   # on the device: carried wheels, then this
    python scripts/gpu_check.py --out DIR                       # every section on one CUDA GPU
    python scripts/gpu_check.py --out DIR --dry-run             # the same steps on CPU: tiny model, gloo
    python scripts/gpu_check.py --out DIR --only train,mask     # some sections (a rerun)

See train/tools/gpu_check.py for the sections and what each measures.
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import sys

from data.errors import one_line_errors
from train.tools.gpu_check import main as gpu_check  # sets PYTORCH_NVML_BASED_CUDA_CHECK before torch is imported

main = one_line_errors(gpu_check)

if __name__ == "__main__":
    sys.exit(main())
