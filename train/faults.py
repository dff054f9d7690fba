"""The faults a cluster produces, and what a run does about them.

- **Preemption** (SIGTERM, or SLURM's ``--signal=USR1@90``): :class:`StopOnSignal` -- the handler
  only sets a flag; at the next optimizer-step boundary every rank agrees on it, ``last.ckpt`` is
  written (model, optimizer and the data cursors of the batch just trained) and the run ends with exit
  code 0. Resuming with ``--ckpt_path last`` continues the identical order: no batch skipped or
  repeated. Lightning's own handlers are replaced for the duration of training: its SIGTERM handler
  kills the other ranks' processes (a collective save then cannot happen) and its SLURM requeue on
  SIGUSR1 checkpoints in the middle of a step, where the in-flight batch is lost on resume.
- **A SIGKILL during a checkpoint write**: the write goes to a temporary file that is renamed into
  place (train/callbacks.py, ``AtomicCheckpointIO``), so the previous checkpoint stays loadable;
  :func:`remove_stale_temp_files` clears the half-written temporary at the next start.
- **A truncated or corrupt checkpoint**: :func:`resolve_checkpoint` checks the file ``--ckpt_path``
  names before Lightning loads it -- a clear error naming the file, or with ``run.ckpt_fallback``
  the newest valid checkpoint of the run (logged). Every checkpoint file has a sidecar ``NAME.sha256``
  (train/callbacks.py) that is verified first: torch's zip reader checks no checksum, so a flipped bit
  inside a tensor, or a corrupt zip member behind an intact index, is "corrupt" like a truncated file.
  Sharded (FSDP) checkpoint folders have no checksum. The per-rank data cursor files the checkpoint
  names (train/cursor_files.py) must all exist, and are range-checked (data/cursor.py
  ``check_order_state``; on several ranks each rank checks its own when it loads it): a missing or
  damaged cursor file makes the checkpoint unusable in the same way.
- **A killed DataLoader worker** (the OOM killer): :class:`StopOnSignal` again -- a checkpoint at the step
  boundary with the last trained cursors, then :class:`DataLoaderWorkerDied` naming the worker (exit 1).
- **Any other fatal error** in a ``python -m train`` process (:func:`arm_fatal_exit`, from
  ``StopOnSignal.on_exception``, before Lightning's teardown): the DataLoader workers are ended at
  once, and if the process is still alive ``FATAL_EXIT_AFTER_S`` later, every thread's stack is
  printed (where it waits) and it exits 1 -- a crash never holds a SLURM allocation to its time limit.
- **A non-finite loss** and **a full disk** are handled where they happen (train/module.py:
  ``on_nonfinite``; train/callbacks.py: ``AtomicCheckpointIO``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch

from data.errors import ConfigError
from train import lightning_internals as internals
from train.callbacks import CHECKSUM_SUFFIX, checksum_path, file_sha256, read_checksum
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
    later. Before: the run directory removed under a running demo made the CSV logger fail, and the
    main process sat in ``waitpid`` on a worker for 20+ minutes."""
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


class DataLoaderWorkerDied(RuntimeError):
    """A DataLoader worker process died (the OOM killer, a segfault); the message says which and what was saved."""


class StopOnSignal(L.Callback):
    """Checkpoint at the next step boundary after SIGTERM/SIGUSR1, then stop cleanly.

    Also a **killed DataLoader worker** (the OOM killer): torch's SIGCHLD handler raised its error at
    whatever bytecode the main thread was running, mid-step, so no consistent checkpoint could be made.
    During training that handler is replaced by one that only sets a flag; at the next optimizer-step
    boundary the workers are looked at and, if one died, ``last.ckpt`` is written (the cursors of the
    last trained step, as for a signal; collectively, every rank agreeing through the same all-reduce)
    and the run ends with :class:`DataLoaderWorkerDied` naming the worker, its pid and how it died
    (exit 1). If torch notices first (its 5 s liveness poll while waiting for that worker's batch,
    which happens between steps), the same checkpoint is written from ``on_exception`` -- on a single
    process only: other ranks cannot join a collective save from there. In the middle of a gradient
    accumulation no checkpoint is written (the last one stands) and the error says so.
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
            if not isinstance(exception, DataLoaderWorkerDied) and _WORKER_DEATH.search(str(exception)):
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


def schedule_fingerprint(schedule: Any, weights: dict[str, float] | None) -> str:
    """The schedule (or fixed mixture) a run trains with, as canonical JSON for its checkpoints.

    A string, so ``torch.load(weights_only=True)`` reads it; compared by :func:`schedule_changes`.
    """
    value = dataclasses.asdict(schedule) if schedule is not None else {"weights": weights}
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def schedule_changes(old: str | None, new: str) -> list[str]:
    """``data.schedule.<key>: OLD -> NEW`` for every value that differs (empty: same, or an old checkpoint
    that did not store it)."""
    if old is None or old == new:
        return []
    out: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif a != b:
            out.append(f"{key}: {a!r} -> {b!r}")

    a, b = json.loads(old), json.loads(new)
    walk(a, b, "data" if "weights" in a and len(a) == 1 else "data.schedule")
    return out


def check_schedule_unchanged(old: str | None, new: str, allow: bool, step: int) -> None:
    """A resume under another schedule silently moves the anneal and the LR decay (a larger
    ``train_tokens`` puts a run that was annealing back into the stable phase): refused like a changed
    seed, unless ``run.allow_changed_schedule``."""
    changes = schedule_changes(old, new)
    if not changes:
        return
    if not allow:
        raise ConfigError(
            f"--ckpt_path: the checkpoint (step {step}) was trained with another schedule: {'; '.join(changes)}; "
            "restore those values, or pass --run.allow_changed_schedule true to continue under the new schedule "
            "from this step (its LR and mixture at this step may jump)"
        )
    log.warning("resuming at step %d under a changed schedule (run.allow_changed_schedule): %s", step,
                "; ".join(changes))


def end_worker_processes() -> list[int]:
    """SIGKILL this process's multiprocessing children (DataLoader workers) after a fatal error.

    The workers ignore SIGTERM (SLURM signals the whole job step; datamodule.ignore_stop_signals), so
    multiprocessing's exit-time ``terminate()`` did nothing and its ``join()`` waited forever: a run whose
    CSV logger failed sat in ``waitpid`` for 20+ minutes, holding its allocation. SIGKILL cannot be
    ignored, and a worker holds nothing that needs a clean shutdown (it only reads parquet).
    """
    import multiprocessing

    pids = []
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
        pids.append(child.pid)
    return pids


def error_lines(e: BaseException) -> str:
    """``error: <key>: <problem>; <what to do>``, one line per problem a ConfigError carries (several
    independent config problems are reported together, so one run of ``train fit`` shows them all)."""
    lines = [ln if ln[:1].isspace() else f"error: {ln}" for ln in str(e).splitlines() if ln.strip()]
    return "\n".join(lines) or f"error: {e!r}"  # indented lines continue the problem above them


def checkpoint_problem(path: Path, cursor_ranks: list[int] | None = None) -> str | None:
    """None if ``path`` opens as a checkpoint (checksum, index and pickled structure, data cursors), else
    what is wrong.

    A file with a sidecar ``NAME.sha256`` is hashed first (streamed in 16 MB blocks; about the time of
    reading the file once); a file without one (written before checksums existed, or a kill between
    the rename and the sidecar) is only opened. A sharded checkpoint folder (FSDP) is not hashed: its
    shards are written by every rank through torch.distributed.checkpoint, not by AtomicCheckpointIO.

    Every data cursor file the checkpoint names must exist; those of ``cursor_ranks`` (default: every
    rank) are read and range-checked (see :func:`resolve_checkpoint` for why the CLI passes fewer).
    """
    if path.is_dir():  # a sharded checkpoint (torch.distributed.checkpoint folder; train/parallel.py)
        return _sharded_checkpoint_problem(path, cursor_ranks)
    problem = checksum_problem(path)
    if problem is not None:
        return problem
    try:
        # mmap: tensors are not read, so this costs milliseconds even for a multi-GB checkpoint;
        # a truncated file fails here (the zip index is at the end of the file).
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 -- any failure to load means "not usable"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first_line}"[:300]
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "global_step" not in ckpt:
        return "not a Lightning checkpoint (no state_dict / global_step)"
    return _cursor_problem(ckpt, path, cursor_ranks)


def _cursor_problem(ckpt: dict, path: Path, ranks: list[int] | None) -> str | None:
    """The data cursors a checkpoint names: every rank's file present, those of ``ranks`` (None: all)
    range-checked and against its step (data/cursor.py). A missing or damaged cursor is refused here,
    naming the file or the field, instead of crashing a DataLoader worker later."""
    from data.cursor import CURSOR_VERSION, check_order_state
    from train.cursor_files import cursor_files, load_checkpoint_cursors

    state = ckpt.get("WellMixedData")
    if not isinstance(state, dict) or (state.get("cursors") is None and state.get("cursor_dir") is None):
        return None  # another datamodule, or an older fresh data order (run.allow_changed_data)
    missing = [f for f in cursor_files(path, state) if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"data cursor file {missing[0]}{more} missing (a checkpoint moved without its cursors/ folder?)"
    try:
        cursors = load_checkpoint_cursors(path, state, ranks)
    except ConfigError as e:
        return str(e)
    if any(isinstance(c, dict) and c.get("version") != CURSOR_VERSION
           for rank in cursors if isinstance(rank, list) for c in rank):
        return None  # another version of the data path: the datamodule's own error says what to do
    if not cursors:
        return None
    try:
        check_order_state({**state, "cursors": cursors}, ranks=ranks)
    except ConfigError as e:
        return str(e)
    return None


def checksum_problem(path: Path) -> str | None:
    """None when ``path`` matches its sidecar checksum or has none; else the mismatch."""
    want = read_checksum(path)
    if want is None:
        return None
    try:
        got = file_sha256(path)
    except OSError as e:
        return f"{type(e).__name__}: {e}"[:300]
    if got == want:
        return None
    return (f"sha256 {got[:16]}... does not match {checksum_path(path).name} ({want[:16]}...): "
            "bits changed after the write (disk, copy or memory error)")


def _sharded_checkpoint_problem(path: Path, cursor_ranks: list[int] | None) -> str | None:
    """A sharded folder: its ``.metadata`` index and Lightning's ``meta.pt`` (step, loops, the data
    state naming the cursor files, which lie beside the folder)."""
    if not (path / ".metadata").is_file():
        return "sharded checkpoint without its .metadata index (incomplete write?)"
    try:
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return f"meta.pt: {type(e).__name__}: {str(e).strip()[:200]}"
    if not isinstance(meta, dict) or "global_step" not in meta:
        return "meta.pt holds no global_step"
    return _cursor_problem(meta, path, cursor_ranks)


def _newest_first(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)


def resolve_checkpoint(ckpt_path: str | None, ckpt_dir: Path, fallback: bool,
                       cursor_ranks: list[int] | None = None) -> str | None:
    """The file to resume from, checked; ``last`` is resolved as Lightning does (newest last*.ckpt).

    Returns None for ``last`` when the run has no checkpoint yet (a requeued job that never saved one
    starts from step 0, as with Lightning). Raises ConfigError naming the file when it is unreadable,
    unless ``fallback``: then the newest readable checkpoint in ``ckpt_dir`` is used, and logged.

    ``cursor_ranks``: whose data cursor files are read and range-checked (default: all; every file's
    presence is always checked). Every rank resolves the checkpoint on its own, before the ranks can
    talk, so each must decide from the same facts or a fallback could pick different checkpoints on
    different ranks. The CLI passes ``[]`` on several ranks (presence only, the same answer everywhere;
    each rank then range-checks its own file when it loads it, an error naming the file) rather than
    have every rank read every rank's cursors here, which this layout exists to avoid.
    """
    if ckpt_path is None or ckpt_path in ("best", "hpc", "registry"):
        return ckpt_path
    if ckpt_path == "last":
        lasts = [p for p in _newest_first(ckpt_dir) if p.name.startswith("last")] if ckpt_dir.is_dir() else []
        if not lasts:
            return _newest_step_file(ckpt_dir, cursor_ranks)
        path = lasts[0]
    else:
        path = Path(ckpt_path)
        if not path.exists():  # a file, or a sharded FSDP checkpoint's folder
            raise ConfigError(f"--ckpt_path {path}: no such file")
    problem = checkpoint_problem(path, cursor_ranks)
    if problem is None:
        return str(path)
    where = path.parent
    if not fallback:
        raise ConfigError(
            f"checkpoint {path} is unreadable (truncated or corrupt?): {problem}. Resume from another file "
            f"with --ckpt_path FILE, or pass --run.ckpt_fallback true to use the newest valid checkpoint in {where}"
        )
    for other in _newest_first(where):
        if other != path and checkpoint_problem(other, cursor_ranks) is None:
            log.warning(
                "checkpoint %s is unreadable (%s); falling back to %s (run.ckpt_fallback)", path, problem, other
            )
            return str(other)
    raise ConfigError(
        f"checkpoint {path} is unreadable ({problem}) and {where} holds no valid checkpoint to fall back to"
    )


def _step_of(path: Path) -> int:
    """The step in a ``stepNNNNNNN.ckpt`` name (FinalCheckpoint's), -1 for other names."""
    digits = path.stem[4:].split("-")[0]
    return int(digits) if path.stem.startswith("step") and digits.isdigit() else -1


def _newest_step_file(ckpt_dir: Path, cursor_ranks: list[int] | None = None) -> str | None:
    """``--ckpt_path last`` without a ``last*.ckpt``: the newest step file that loads.

    A kill between a step file's rename and its ``last.ckpt`` link (or a deleted ``last.ckpt``) leaves
    step files only; starting from step 0 would retrain the run and rewrite its order log. Newest by
    the step in the name (a copied or restored file's mtime says nothing), then by mtime. Only a run
    dir without any checkpoint file starts from step 0; one whose files all fail to load is an error.
    """
    files = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: (_step_of(p), p.stat().st_mtime),
                   reverse=True) if ckpt_dir.is_dir() else []
    if not files:
        log.warning("--ckpt_path last: no checkpoint in %s yet; starting from step 0", ckpt_dir)
        return None
    skipped = []
    for path in files:
        problem = checkpoint_problem(path, cursor_ranks)
        if problem is None:
            log.warning("--ckpt_path last: no last.ckpt in %s; resuming from the newest loadable step file %s%s",
                        ckpt_dir, path, f" (unreadable, skipped: {', '.join(skipped)})" if skipped else "")
            return str(path)
        skipped.append(f"{path.name}: {problem}")
    raise ConfigError(
        f"--ckpt_path last: {ckpt_dir} holds checkpoint files but none loads ({'; '.join(skipped)}); "
        "restore a checkpoint, or move them away to start from step 0 deliberately"
    )


def remove_stale_temp_files(ckpt_dir: Path) -> list[Path]:
    """Half-written ``.NAME.tmpPID`` files of a save that was killed (AtomicCheckpointIO); they can be
    as large as a checkpoint. Called before training starts, when no save can be in progress.

    Also the temporaries of checksum sidecars, and sidecars whose checkpoint is gone (a kill between
    keep_last_k's removal of a file and of its sidecar)."""
    stale = []
    if ckpt_dir.is_dir():
        stale = sorted(ckpt_dir.glob(".*.ckpt.tmp*")) + sorted(ckpt_dir.glob(f".*.ckpt{CHECKSUM_SUFFIX}.*.tmp"))
        stale += [p for p in sorted(ckpt_dir.glob(f"*.ckpt{CHECKSUM_SUFFIX}"))
                  if not p.with_name(p.name[: -len(CHECKSUM_SUFFIX)]).exists()]
    for p in stale:
        p.unlink(missing_ok=True)
        log.warning("removed %s, left by a checkpoint write that did not finish", p)
    return stale
