"""One-command evaluation of a run or checkpoint: held-out loss per source, HF export, lm-eval.

    python scripts/evaluate.py runs/demo
    python scripts/evaluate.py runs/demo/checkpoints/last.ckpt --tasks hellaswag --lm-eval-args "--limit 100"

See train/evaluate.py for the steps and where the results go.
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import sys

from data.errors import one_line_errors
from train.evaluate import main as evaluate
from train.model import ModelConfigError

main = one_line_errors(evaluate, also=(ModelConfigError,))

if __name__ == "__main__":
    sys.exit(main())
