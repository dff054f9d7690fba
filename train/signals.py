"""Signals and fatal errors: the faults a cluster produces, and what a run does about them (the whole
table, with the lines a user sees: docs/faults.md).

- **Preemption** (SIGTERM, or SLURM's ``--signal=USR1@90``) and **a killed DataLoader worker** (the OOM
  killer): :class:`StopOnSignal` -- the handler only sets a flag; at the next optimizer-step boundary
  every rank agrees on it, ``last.ckpt`` is written (with the data cursors of the batch just trained)
  and the run ends (exit 0; for a dead worker :class:`DataLoaderWorkerDied`, exit 1). Lightning's own
  handlers are replaced while training: its SIGTERM handler kills the other ranks' processes, and its
  SLURM requeue on SIGUSR1 checkpoints mid-step, where the in-flight batch is lost on resume.
- **Any other fatal error** in a ``python -m train`` process (:func:`arm_fatal_exit`): the DataLoader
  workers are ended at once, and if the process is still alive ``FATAL_EXIT_AFTER_S`` later, every
  thread's stack is printed and it exits 1 -- a crash never holds a SLURM allocation to its time limit.
- Checkpoint writes and reads (a kill mid-write, a corrupt file, a full disk) are train/checkpoint.py's
  and train/checkpoint_io.py's; a non-finite loss is train/module.py's; a changed schedule train/resume.py's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path

import lightning as L
import torch

from train import lightning_internals as internals
from train.early_signals import EARLY as _EARLY
from train.early_signals import STOP_SIGNALS, install_early_handlers  # noqa: F401 (re-exported for the CLI)

log = logging.getLogger("wellmixed")


FATAL_EXIT_AFTER_S: float | None = None
"""Set by the CLI (train/cli.py ``main``): after a fatal error the process ends within this many seconds,
whatever Lightning's teardown waits on. None in library use, where a caller may catch the error."""
_ARMED = threading.Event()
_TIMER: list[threading.Timer] = []


def arm_fatal_exit(exception: BaseException) -> None:
    """After a fatal error, in a CLI process: end the DataLoader workers now (teardown then has none to
    wait on), and exit 1 with every thread's stack if the process has not ended ``FATAL_EXIT_AFTER_S``
    later: a crash never holds an allocation until its time limit."""
    if FATAL_EXIT_AFTER_S is None or _ARMED.is_set():
        return
    _ARMED.set()
    pids = end_worker_processes()
    if pids:
        print(f"fatal {type(exception).__name__}: ended its DataLoader worker(s) {pids}", file=sys.stderr, flush=True)

    def exit_now() -> None:
        print(f"fatal {type(exception).__name__}: {exception}\nthe process did not end within "
              f"{FATAL_EXIT_AFTER_S:.0f} s of it; exiting 1. Where each thread waited:", file=sys.stderr, flush=True)
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            print(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(FATAL_EXIT_AFTER_S, exit_now)
    timer.daemon = True
    timer.start()
    _TIMER.append(timer)


def disarm_fatal_exit() -> None:
    """Library use again (tests call the CLI's ``main`` in-process): no watchdog, none pending."""
    global FATAL_EXIT_AFTER_S
    FATAL_EXIT_AFTER_S = None
    while _TIMER:
        _TIMER.pop().cancel()
    _ARMED.clear()


WORKER_DIED = 1 << 10  # StopOnSignal's all-reduced stop code for "a DataLoader worker died" (above any signal)
_WORKER_DEATH = re.compile(r"DataLoader worker \(pid")


def _cut_off_by_a_dead_worker(trainer, exception: BaseException) -> bool:
    """A worker killed while the main process was receiving its batch (the tensor's file descriptor is
    passed over a socket the kill resets): torch raises the socket's error, not its worker report."""
    return isinstance(exception, (ConnectionError, EOFError)) and bool(internals.dead_loader_workers(trainer))


class DataLoaderWorkerDied(RuntimeError):
    """A DataLoader worker process died (the OOM killer, a segfault); the message says which and what was saved."""


class StopOnSignal(L.Callback):
    """Checkpoint at the next step boundary after SIGTERM/SIGUSR1, then stop cleanly.

    Also a **killed DataLoader worker** (docs/faults.md): torch's SIGCHLD handler would raise mid-step,
    so during training it is replaced by one that only sets a flag; at the next optimizer-step boundary
    the ranks agree, ``last.ckpt`` is written and the run ends with :class:`DataLoaderWorkerDied` (exit
    1). If torch notices first (its liveness poll between steps), the same checkpoint is written from
    ``on_exception``, on a single process only (other ranks cannot join a collective save from there).
    Mid-accumulation no checkpoint is written and the error says so.
    """

    def __init__(self, ckpt_dir: str):
        self.ckpt_dir = Path(ckpt_dir)
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._last_step = -1
        self._child_exited = False
        self._in_step = False  # between on_train_batch_start and on_train_batch_end
        self._partial = False  # micro-batches trained since the last optimizer step
        self._died_saved = False

    def _handler(self, signum, frame) -> None:
        self.received = signum  # nothing else: a signal can arrive in the middle of anything

    def _on_child_exit(self, signum, frame) -> None:
        self._child_exited = True  # looked at at the next step boundary (torch's handler raised mid-step)

    def on_train_start(self, trainer, pl_module) -> None:
        # Installed here, after Lightning registered its own (trainer._run), so these replace them.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        if _EARLY and self.received is None:
            self.received = _EARLY[0]
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._in_step = True
        # torch sets its SIGCHLD handler when the DataLoader's workers start (after on_train_start)
        if signal.SIGCHLD not in self._previous and threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._on_child_exit)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._in_step = False
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            self._partial = True
            return
        self._partial = False
        self._last_step = trainer.global_step
        code = 0 if self.received is None else int(self.received)
        dead = []
        if self._child_exited:
            dead = internals.dead_loader_workers(trainer)
            self._child_exited = bool(dead)  # another child (not a worker) ended: nothing to do
            code = WORKER_DIED if dead else code
        if trainer.world_size > 1:
            # Every rank must take the same decision (the save is collective); a signal that reached
            # one rank's process is enough. One 4-byte all-reduce per step.
            flag = torch.tensor([code], device=pl_module.device)
            code = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if not code:
            return
        path = self.ckpt_dir / "last.ckpt"
        # DataStateCallback.on_train_batch_end ran before this (callback order), so the cursor of the
        # batch just trained is the one written.
        trainer.save_checkpoint(str(path))
        if code == WORKER_DIED:
            self._died_saved = True
            msg = worker_death_message(dead, trainer.global_step, path, rank=trainer.global_rank)
            log.error("%s", msg)
            raise DataLoaderWorkerDied(msg)
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.warning("received %s: checkpoint of step %d (data cursors included) written to %s; stopping. "
                        "Resume with --ckpt_path last", signal.Signals(code).name, trainer.global_step, path)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """torch's own report of a dead worker (raised while fetching the next batch, between steps);
        then, for any fatal error, :func:`arm_fatal_exit`."""
        try:
            if not isinstance(exception, DataLoaderWorkerDied) and (
                    _WORKER_DEATH.search(str(exception)) or _cut_off_by_a_dead_worker(trainer, exception)):
                self._checkpoint_after_worker_death(trainer, exception)
        finally:
            arm_fatal_exit(exception)

    def _checkpoint_after_worker_death(self, trainer, exception: BaseException) -> None:
        dead = internals.dead_loader_workers(trainer)
        path = None
        if self._in_step or self._partial:
            why = "it died in the middle of a step or gradient accumulation"
        elif trainer.world_size > 1:
            why = "the other ranks cannot join a checkpoint from here"
        elif self._last_step < 0 or self._died_saved:
            why = "training had not started" if self._last_step < 0 else ""
        else:
            path = self.ckpt_dir / "last.ckpt"
            try:
                trainer.save_checkpoint(str(path))
                why = ""
            except Exception as e:  # noqa: BLE001 -- report the worker's death, not this
                path, why = None, f"the checkpoint failed: {e}"
        msg = worker_death_message(dead, trainer.global_step, path, rank=trainer.global_rank, reason=why,
                                   torch_said=str(exception).strip().splitlines()[0])
        log.error("%s", msg)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if previous is not None:  # None: the handler was not installed from Python
                signal.signal(sig, previous)
        self._previous = {}


def worker_death_message(dead: list, step: int, saved: Path | None, rank: int = 0, reason: str = "",
                         torch_said: str = "") -> str:
    """One line: which worker died and how, what was saved, what to do."""
    if dead:
        parts = []
        for i, pid, code, n in dead:
            how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exit code {code}")
            parts.append(f"DataLoader worker {i} of {n} (pid {pid}) of rank {rank} died ({how})")
        what = "; ".join(parts)
    elif torch_said:
        what = f"a DataLoader worker of rank {rank} died ({torch_said})"
    else:
        what = "a DataLoader worker on another rank died"
    hint = " (the OOM killer? lower data.num_workers, data.buffer_size or data.open_shards)"
    if saved is not None:
        return (f"{what}{hint}; checkpoint of step {step} (data cursors of the last trained step) written to "
                f"{saved}; resume with --ckpt_path last")
    return f"{what}{hint}; no checkpoint written{f' ({reason})' if reason else ''}: resume from the last one " \
           "with --ckpt_path last"


def end_worker_processes() -> list[int]:
    """SIGKILL this process's multiprocessing children (DataLoader workers) after a fatal error.

    The workers ignore SIGTERM (SLURM signals the whole job step; datamodule.ignore_stop_signals), so
    multiprocessing's exit-time ``terminate()`` does nothing and its ``join()`` would wait forever. SIGKILL
    cannot be ignored, and a worker holds nothing that needs a clean shutdown (it only reads parquet).
    """
    pids = []
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
        pids.append(child.pid)
    return pids
