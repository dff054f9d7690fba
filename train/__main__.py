"""python -m train fit --config configs/demo.yaml [--ckpt_path last]"""

import sys

from train.malloc import keep_freed_memory

keep_freed_memory()

from train.cli import main  # noqa: E402

sys.exit(main())
