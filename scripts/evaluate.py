"""One-command evaluation of a run or checkpoint: held-out loss per source, HF export, lm-eval.

    python scripts/evaluate.py runs/demo
    python scripts/evaluate.py runs/demo/checkpoints/last.ckpt --tasks hellaswag --lm-eval-args "--limit 100"

See train/tools/evaluate.py for the steps and where the results go.
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import sys

from data.errors import one_line_errors
from train.model import ModelConfigError
from train.tools.evaluate import main as evaluate

main = one_line_errors(evaluate, also=(ModelConfigError,))

if __name__ == "__main__":
    sys.exit(main())
