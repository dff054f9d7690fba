"""One-command evaluation of a run or checkpoint: held-out loss per source, HF export, lm-eval.

    python scripts/evaluate.py runs/demo
    python scripts/evaluate.py runs/demo/checkpoints/last.ckpt --tasks hellaswag --lm-eval-args "--limit 100"

See train/evaluate.py for the steps and where the results go.
"""

import sys

from train.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
