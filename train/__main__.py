"""python -m train fit --config configs/demo.yaml [--ckpt_path last]"""

import sys

from train.cli import main

sys.exit(main())
