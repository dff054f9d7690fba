"""Flag-only SIGTERM/SIGUSR1 handlers from the first line of ``python -m train`` (no heavy imports here).

Importing torch and Lightning takes seconds; a SIGTERM (or SLURM's SIGUSR1) in that window would kill the
process outright (their default action). ``train/__main__.py`` installs these before it imports anything
else; train/signals.py's StopOnSignal reads the flag at the first step boundary (checkpoint, exit 0).
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EARLY: list[int] = []  # signals received before training started (imports, start-up, data loading)


def install_early_handlers() -> None:
    """Flag-only handlers; idempotent. Only the main thread can install signal handlers."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: EARLY.append(signum))
