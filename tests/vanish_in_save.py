"""``python tests/vanish_in_save.py fit ARGS``: ``python -m train fit ARGS`` whose rank 1 stops dead (SIGSTOP: no
exit, no closed socket, as when its node's link is cut) inside the checkpoint save of step
``WELLMIXED_TEST_VANISH_AT_STEP``, right after writing its data cursor file, before the save's gather. A script
file, not a module: Lightning starts rank 1 with this same command line, so the patch reaches it."""

import os
import signal
import sys

import train.datamodule

STEP = int(os.environ["WELLMIXED_TEST_VANISH_AT_STEP"])
save_rank_cursors = train.datamodule.save_rank_cursors


def vanishing_save(step_dir, rank, cursors, next_step):
    digest = save_rank_cursors(step_dir, rank, cursors, next_step)
    if rank == 1 and os.path.basename(step_dir) == f"step{STEP:07d}":
        os.kill(os.getpid(), signal.SIGSTOP)
    return digest


train.datamodule.save_rank_cursors = vanishing_save
if __name__ == "__main__":
    from train.__main__ import main

    sys.exit(main())
