"""python -m train fit --config configs/demo.yaml [--ckpt_path last]"""

import sys

from train.early_signals import install_early_handlers

install_early_handlers()  # before torch's seconds of imports: a SIGTERM then is a flag, not a kill

from train.malloc import keep_freed_memory  # noqa: E402

keep_freed_memory()

from train.cli import main  # noqa: E402

sys.exit(main())
