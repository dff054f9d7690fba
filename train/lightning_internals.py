"""Every place wellmixed reaches into Lightning's internals, in one file, with the version it was written for.

Written against Lightning 2.6 (2.6.6); :func:`check_version` warns once when another minor version is
installed, because each item below reads or overrides something Lightning does not promise to keep:

- :func:`set_max_steps`, :func:`align_accumulation_phase`: the fit loop's ``max_steps`` and micro-batch
  counters (``fit_loop.epoch_loop``);
- :func:`set_collective_timeout`: a parallel strategy's ``_timeout``, handed to ``init_process_group``;
- :func:`dead_loader_workers`: the DataLoader's worker processes, through the fit loop's data fetcher;
- :class:`ResumableCSVLogger`: CSVLogger's writer without its deletion of ``metrics.csv`` at start;
- :class:`FSDP2Strategy`: ModelParallelStrategy's private mesh sizes, set to pure data parallelism;
- :func:`ddp_kwargs`: what DDPStrategy passes to DistributedDataParallel, also when Lightning chose it;
- :class:`CheckpointHooks`, :class:`CLIHooks`: ModelCheckpoint's private saves of a step file and of
  ``last.ckpt`` (and what it saved last), LightningCLI's ``_parse_ckpt_path`` and ``_instantiate_trainer``,
  under public names that train/checkpoint_io.py and train/cli.py override.

And the three places the configuration parser reaches into jsonargparse (4.53) and argparse (Python 3.11):
:func:`parser_actions` (argparse's ``_actions``), :func:`wrap_config_loader` (the action's
``_load_config``: train/config.py looks for ``model: {model: FILE}`` in the repository too) and, in
data/config.py (which cannot import this file: no torch there), ``jsonargparse._util.config_load_stack``,
the file being read, which its YAML loader names when it refuses a key given twice.

Each has a test that fails when Lightning changes what it relies on (tests/integration: resume with
another accumulation, the dead-worker checkpoint, a resumed metrics.csv, last.ckpt at the final step).
"""

from __future__ import annotations

import csv
import datetime
import io
import logging
import os

import jsonargparse
import lightning
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies import ModelParallelStrategy

from data import files

log = logging.getLogger(__name__)

WRITTEN_FOR = (2, 6)
"""The Lightning (major, minor) these functions were written and tested against."""
JSONARGPARSE_WRITTEN_FOR = (4, 53)
"""The jsonargparse (major, minor) of :func:`wrap_config_loader`."""
_warned = False


def check_version() -> None:
    """Warn once when the installed Lightning is not the minor version this file was written for."""
    global _warned
    for module, written_for in ((lightning, WRITTEN_FOR), (jsonargparse, JSONARGPARSE_WRITTEN_FOR)):
        installed = tuple(int(x) for x in module.__version__.split(".")[:2])
        if installed != written_for and not _warned:
            _warned = True
            log.warning("%s %s is installed; train/lightning_internals.py was written for %d.%d: if resume, "
                        "metrics.csv, worker checks or the config parser misbehave, look there first",
                        module.__name__, module.__version__, *written_for)


def set_max_steps(trainer, max_steps: int) -> None:
    """The Trainer's step budget after construction (the schedule decides it, after the config is parsed)."""
    trainer.fit_loop.epoch_loop.max_steps = max_steps


def set_collective_timeout(strategy, seconds: float) -> None:
    """The process group's timeout (torch.distributed.init_process_group's ``timeout``: gloo's per-operation
    timeout, NCCL's watchdog) of a parallel strategy not yet set up: its private ``_timeout``, which
    Lightning passes on (default: 30 minutes for every backend). A single-device strategy has none."""
    if hasattr(strategy, "_timeout"):
        strategy._timeout = datetime.timedelta(seconds=seconds)


def align_accumulation_phase(trainer) -> None:
    """After a resume, make Lightning's micro-batch counters say ``global_step x accumulation``.

    Lightning ends an optimizer step by its restored micro-batch count (``ready % accumulate_grad_batches``),
    so a resume with another accumulation would put every step boundary out of phase. Checkpoints are
    written at step boundaries: shifting every counter by the same amount (keeping the relations Lightning's
    restart logic reads) fixes the phase; for an unchanged accumulation the shift is 0.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = trainer.global_step * trainer.accumulate_grad_batches - progress.current.ready
    if trainer.global_step == 0 or shift == 0:
        return
    for tracker in (progress.current, progress.total):
        tracker.ready += shift
        tracker.started += shift
        tracker.processed += shift
        tracker.completed += shift


def ddp_kwargs(strategy) -> dict:
    """The keyword arguments a DDPStrategy (also the one ``auto`` picks) passes to DistributedDataParallel;
    changes take effect when it wraps the model (train/parallel.py fix_bucket_layout)."""
    return strategy._ddp_kwargs


class CheckpointHooks(ModelCheckpoint):
    """ModelCheckpoint whose saves are public methods a subclass overrides and calls back:
    :meth:`save_step_file` where Lightning saves a step file (top-k by ``monitor``), :meth:`save_last_file`
    where it saves ``last.ckpt``; and what it saved last, :attr:`last_saved_path` and :attr:`last_saved_step`."""

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        self.save_step_file(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        self.save_last_file(trainer, monitor_candidates)

    def save_step_file(self, trainer, monitor_candidates) -> None:
        """Lightning's save of a step file."""
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def save_last_file(self, trainer, monitor_candidates) -> None:
        """Lightning's save of ``last.ckpt``."""
        super()._save_last_checkpoint(trainer, monitor_candidates)

    @property
    def last_saved_path(self) -> str:
        """The file of the last save ("" before any)."""
        return self._last_checkpoint_saved

    @property
    def last_saved_step(self) -> int:
        """The global step of the last save (0 before any)."""
        return self._last_global_step_saved

    def monitor_candidates(self, trainer) -> dict:
        """The metrics a save's file name and top-k choice read (``step`` among them)."""
        return self._monitor_candidates(trainer)


class CLIHooks(LightningCLI):
    """LightningCLI with public hooks: :meth:`check_ckpt_path` right after the command line is parsed,
    :meth:`trainer_arguments` on the Trainer's keyword arguments and the callbacks the parser made, just
    before the Trainer is built."""

    def _parse_ckpt_path(self) -> None:
        self.check_ckpt_path()

    def check_ckpt_path(self) -> None:
        """Lightning's: the ``model:`` settings replaced by those of the ``--ckpt_path`` file."""
        super()._parse_ckpt_path()

    def trainer_arguments(self, config: dict, callbacks: list) -> tuple[dict, list]:
        """The Trainer's keyword arguments and extra callbacks to build it with (here: unchanged)."""
        return config, callbacks

    def _instantiate_trainer(self, config, callbacks):
        config, callbacks = self.trainer_arguments(config, callbacks)
        return super()._instantiate_trainer(config, callbacks)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy over a 1-D mesh of every rank (pure FSDP, no tensor parallelism):
    its "auto" would make data parallel = nodes and tensor parallel = devices per node."""

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        super().setup_environment()


def dead_loader_workers(trainer) -> list[tuple[int, int, int | None, int]]:
    """``(worker index, pid, exit code, workers)`` of the training DataLoader's worker processes that
    ended (best effort: found through Lightning's data fetcher; empty when not found)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    combined = getattr(fetcher, "iterator", None)
    inner = getattr(combined, "_iterator", None)
    out = []
    for it in getattr(inner, "iterators", None) or []:
        workers = list(getattr(it, "_workers", None) or [])
        for i, w in enumerate(workers):
            if not w.is_alive():
                out.append((i, w.pid, w.exitcode, len(workers)))
    return out


class ResumableCSVLogger(CSVLogger):
    """CSVLogger that continues an existing ``metrics.csv`` instead of deleting it (Lightning's writer
    removes the file when it starts). :meth:`drop_steps_from` cuts the rows of steps >= the step training
    starts at (logged by a launch killed after its checkpoint), so the file holds each step once. Every
    rewrite is atomic, and ``metrics.csv`` / ``hparams.yaml`` are never written through a symbolic link.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    def drop_steps_from(self, step: int) -> int:
        """Remove the rows of steps >= ``step`` from ``metrics.csv`` (global rank 0); how many were removed."""
        return self.experiment.drop_steps_from(step)


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        for name in (self.NAME_METRICS_FILE, self.NAME_HPARAMS_FILE):
            files.refuse_link(os.path.join(self.log_dir, name), "the metrics file")
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])  # new columns rewrite the file with both

    def save(self) -> None:
        try:
            super().save()
        except OSError as e:
            raise files.write_error(self.metrics_file_path, e, "resume with --ckpt_path last") from e

    def _rewrite(self, fieldnames: list[str], rows: list[dict]) -> None:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=fieldnames, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        files.write_text(self.metrics_file_path, out.getvalue())

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:  # Lightning's rewrites in place
        with open(self.metrics_file_path, newline="") as f:
            self._rewrite(fieldnames, list(csv.DictReader(f)))

    def drop_steps_from(self, step: int) -> int:
        self.metrics = [m for m in self.metrics if int(m.get("step", -1)) < step]
        if not os.path.isfile(self.metrics_file_path):
            return 0
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            fieldnames = list(reader.fieldnames or [])
        keep = [r for r in rows if not (r.get("step") or "").isdigit() or int(r["step"]) < step]
        if len(keep) < len(rows):
            self._rewrite(fieldnames, keep)
        return len(rows) - len(keep)


def parser_actions(parser) -> list:
    """Every option of an argparse (or jsonargparse) parser: argparse's ``_actions``."""
    return parser._actions


def wrap_config_loader(parser, dest: str, wrap) -> None:
    """``wrap(load)`` in place of jsonargparse's loader of the group ``dest`` given as a file
    (``--model.model FILE``): ``wrap`` returns a function of ``(value, parser)`` that calls ``load``."""
    action = next(a for a in parser_actions(parser) if a.dest == dest)
    action._load_config = wrap(action._load_config)
