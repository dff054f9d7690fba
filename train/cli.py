"""``python -m train fit --config CONFIG [--ckpt_path last]``: LightningCLI over the module and the data.

The parser (sections ``model:``, ``data:``, ``trainer:``, ``run:``; stacked ``--config`` files and
``--data.seed 7``-style overrides; one-line errors; the help) is train/config.py's, shared with every
tool. What this file adds to it (docs/training.md describes each for the user):
- derived Trainer defaults: ``max_steps`` from the schedule's token budget, bf16-mixed on GPU and fp32
  on CPU, validation every ``run.val_every_n_steps`` steps of the (endless) stream, no distributed
  sampler (the data layer slices the global order itself), gradient clipping 1.0;
- loggers from ``run.loggers`` (train/loggers.py), made once the start-up checks pass; ``--trainer.logger``,
  ``--optimizer`` and ``--lr_scheduler`` are not offered (LightningCLI's would silently replace model.optim
  and the schedule's LR); only the ``fit`` and ``validate`` subcommands;
- checkpoints every ``run.ckpt_every_n_steps`` plus ``last``; ``--ckpt_path`` found and verified before
  it is loaded (train/checkpoint.py) and its ``model:`` settings checked (train/resume.py); SIGTERM and
  SIGUSR1 checkpoint and stop at the next step (train/signals.py), Lightning's SLURM requeue off;
- start-up checks before any compute and before anything is written into ``run.dir``: the checkpoint,
  the manifest, the plan table, the schedule against the model's context, the memory estimate on a GPU;
- the config saved per launch as ``<run>/config-NNN.yaml``, ``<run>/config.yaml`` the latest.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment

from data.errors import ConfigError, WellMixedError, error_lines
from data.tokenizer import TokenizerConfig
from data.types import TrainingContext
from train import lightning_internals as internals
from train import loggers as run_loggers
from train import signals
from train.callbacks import DataStateCallback, ProgressLog, ThroughputCallback
from train.checkpoint import (
    LAST,
    LAST_OR_NEW,
    recorded_step,
    remove_unreferenced,
    requested_hparams,
    resolve_checkpoint,
    saved_hparams,
)
from train.checkpoint_io import AtomicCheckpointIO, FinalCheckpoint, remove_stale_temp_files
from train.config import ConfigCLI, RunConfig, config_sources
from train.datamodule import WellMixedData
from train.launch import EXIT_PEER_LOST, report_lost_peers
from train.model import ModelConfigError
from train.module import PretrainModule
from train.parallel import check_checkpoint_layout, fix_bucket_layout, resolve_strategy
from train.resume import check_resume
from train.rundir import RunDir
from train.rundir_lock import acquire_run_dir
from train.signals import (
    StopOnSignal,
    end_worker_processes,
    install_early_handlers,
)

log = logging.getLogger("wellmixed")


def newest_checkpoint(ckpt_dir: Path) -> tuple[Path | None, int]:
    """The checkpoint of ``ckpt_dir`` that records the highest step, and that step ((None, -1): none opens)."""
    steps = {p: recorded_step(p) for p in ckpt_dir.glob("*.ckpt")}
    newest = max((p for p in steps if steps[p] is not None), key=steps.get, default=None)
    return newest, -1 if newest is None else steps[newest]


class WellMixedCLI(internals.CLIHooks, ConfigCLI):
    """The parser of train/config.py, plus what a run does before and around ``trainer.fit`` (through
    train/lightning_internals.py's hooks: the ``--ckpt_path`` check, the Trainer's arguments)."""

    def __init__(self, args=None, run: bool = True, **kwargs):
        # the module class is looked up here at each start (fault-injection tests swap train.cli.PretrainModule)
        super().__init__(args=args, run=run, model_class=PretrainModule, **kwargs)

    def check_ckpt_path(self) -> None:
        """``--ckpt_path`` checked when the command line is parsed (train/checkpoint.py ``requested_hparams``).
        LightningCLI would also replace every ``model:`` setting by the checkpoint's; here :meth:`before_fit`
        compares them (train/resume.py) once the checkpoint to load is known."""
        if not self.config.get("subcommand"):
            return
        section = self.config[self.config.subcommand]
        requested_hparams(section.get("ckpt_path"), RunDir(section.run.dir).checkpoints, section.run.ckpt_fallback,
                          section.run.allow_unverified_ckpt)

    def before_instantiate_classes(self) -> None:
        cfg = self._section()
        tr, run = cfg.trainer, cfg.run
        if tr.precision is None:
            tr.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
        if tr.gradient_clip_val is None:
            tr.gradient_clip_val = 1.0
        tr.use_distributed_sampler = False
        tr.check_val_every_n_epoch = None
        tr.val_check_interval = run.val_every_n_steps
        tr.log_every_n_steps = run.log_every_n_steps
        if tr.num_sanity_val_steps is None:
            tr.num_sanity_val_steps = 0
        if tr.enable_progress_bar is None and not sys.stderr.isatty():
            tr.enable_progress_bar = False
        cfg.model.log_every_n_steps = run.log_every_n_steps
        run.loggers = run_loggers.resolve(run.loggers, run.wandb)  # the saved config shows what ran
        run.wandb = "wandb" in run.loggers
        # data.tokenizer built (its file loaded and hash-checked) in the main process before the model is built,
        # else a corrupt file shows up as a DataLoader-worker traceback after it
        TokenizerConfig(**cfg.data.tokenizer.as_dict()).build()

    def trainer_arguments(self, config: dict, callbacks: list) -> tuple[dict, list]:
        """The Trainer's run directory, first logger, plugins (atomic checkpoint writes), strategy and the
        run's callbacks."""
        run: RunConfig = self._section().run
        run_dir = RunDir(run.dir)
        config["default_root_dir"] = str(run_dir.root)
        # CSV only until before_fit has validated everything: the others (wandb's run id file) write into
        # the run dir when they are made; before_fit sets the full list
        config["logger"] = self._loggers(["csv"])
        config["plugins"] = [AtomicCheckpointIO()]
        config["strategy"] = resolve_strategy(config.get("strategy", "auto"))  # fsdp: one unit per block
        if SLURMEnvironment.detect():
            # Lightning's auto-requeue checkpoints inside the SIGUSR1 handler, mid-step (the batch in
            # flight is lost on resume; it can hang, Lightning #21406). StopOnSignal checkpoints at the
            # next step boundary instead and scripts/slurm/train.sbatch requeues the job.
            config["plugins"].append(SLURMEnvironment(auto_requeue=False))
        callbacks = list(callbacks) + [
            DataStateCallback(str(run_dir.root)),
            ProgressLog(run.print_every_n_steps if config.get("enable_progress_bar") is False else 0),
            StopOnSignal(str(run_dir.checkpoints)),  # after DataStateCallback: the cursor is recorded first
            ThroughputCallback(run.peak_flops, log_every_n_steps=run.log_every_n_steps),
            FinalCheckpoint(dirpath=str(run_dir.checkpoints), filename="step{step:07d}",
                            auto_insert_metric_name=False, every_n_train_steps=run.ckpt_every_n_steps,
                            save_top_k=run.keep_last_k, monitor="step", mode="max", save_last=True),
        ]
        return config, callbacks

    def _loggers(self, names: list[str]) -> list:
        run: RunConfig = self._section().run
        return run_loggers.build(names, RunDir(run.dir).root, wandb_project=run.wandb_project,
                                 wandb_name=run.wandb_name, wandb_group=run.wandb_group)

    def _check_resume_settings(self, ckpt_path: str | None) -> None:
        """The resume rule (train/resume.py): the checkpoint's must-match ``model:`` settings against the
        run's, a difference refused by name; the settings that may change are applied and logged."""
        if ckpt_path is None:
            return
        saved = saved_hparams(Path(ckpt_path))
        lr_may_change = self._section().run.allow_changed_schedule
        for line in check_resume(ckpt_path, saved, dict(self.model.hparams), lr_may_change):
            log.warning("resume from %s: %s (a setting that may change on resume: applied)", ckpt_path, line)

    def before_validate(self) -> None:
        """``--ckpt_path`` found and verified as for fit (``last`` by the step recorded inside), not by
        Lightning's own lookup of the newest file; its model settings compared as for fit."""
        section, run = self._section(), self._section().run
        ckpt_path = resolve_checkpoint(section.get("ckpt_path"), RunDir(run.dir).checkpoints, run.ckpt_fallback,
                                       cursors=False, unverified_ok=run.allow_unverified_ckpt)
        self._check_resume_settings(ckpt_path)
        self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        self.trainer.loggers = self._loggers(run.loggers)

    def before_fit(self) -> None:
        """Everything that can be wrong is checked here, before the first step, and before anything is
        written into the run directory (its lock, the mapping report, the loggers' files)."""
        dm: WellMixedData = self.datamodule
        run: RunConfig = self._section().run
        ckpt_dir = RunDir(run.dir).checkpoints
        internals.check_version()
        if not run.collective_timeout_s > 0:
            raise ConfigError(f"run.collective_timeout_s is {run.collective_timeout_s}: give the seconds a collective "
                              "may wait for the other ranks (> 0; default 600)")
        internals.set_collective_timeout(self.trainer.strategy, run.collective_timeout_s)
        if self._section().get("ckpt_path") is None and ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
            raise ConfigError(
                f"run.dir {ckpt_dir.parent} already holds checkpoints: resume with --ckpt_path last, "
                "or choose a new --run.dir"
            )
        # A checked file instead of Lightning's "last" lookup; on several ranks []: see resolve_checkpoint.
        cursor_ranks = None if self.trainer.world_size == 1 else []
        ckpt_path = resolve_checkpoint(self._section().get("ckpt_path"), ckpt_dir, run.ckpt_fallback, cursor_ranks,
                                       unverified_ok=run.allow_unverified_ckpt)
        self._refuse_rewind_from_a_config_file(ckpt_path, ckpt_dir)
        self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        check_checkpoint_layout(ckpt_path, self.trainer.strategy)
        fix_bucket_layout(self.trainer.strategy)  # DDP: a resume reduces its gradients as the run it continues
        self._check_resume_settings(ckpt_path)
        steps = self.config_init[self.subcommand].data.schedule.build()  # the run's steps: no corpus read yet
        lr = self.model.lr.build(steps.total_steps, steps.anneal_step)  # model.lr checked on them
        data = dm.prepare(self.trainer.accumulate_grad_batches)
        self._check_data(data, lr)
        self._check_memory(data, run)
        # validated: now the run dir is taken and written to
        if self.trainer.is_global_zero:  # nothing may touch the run dir another run holds
            acquire_run_dir(run.dir)
            remove_stale_temp_files(ckpt_dir)
            remove_unreferenced(ckpt_dir)  # cursor folders of a save that was killed, or of a replaced last.ckpt
            from data.mapping import write_mapping_report

            write_mapping_report(data.manifest.mapping, run.dir)  # filter patterns -> values, kept in the run dir
        self.trainer.loggers = self._loggers(run.loggers)

    def _refuse_rewind_from_a_config_file(self, ckpt_path: str | None, ckpt_dir: Path) -> None:
        """A saved ``<run>/config.yaml`` records the checkpoint its launch resumed from: relaunched from that
        file, a run would go back to that checkpoint and train the steps after it again without a word. A
        ``ckpt_path`` file from a config file that is older than the run's newest checkpoint is refused; on
        the command line it is a deliberate rewind."""
        given = self._section().get("ckpt_path")
        if ckpt_path is None or given in (LAST, LAST_OR_NEW) or any(
                a.split("=")[0] == "--ckpt_path" for a in self.argv):
            return
        newest, newest_step = newest_checkpoint(ckpt_dir)
        step = recorded_step(Path(ckpt_path))
        if newest is not None and step is not None and newest_step > step:
            raise ConfigError(
                f"ckpt_path {given} (from {config_sources(self._section())}) is step {step}, but {ckpt_dir} holds "
                f"step {newest_step} ({newest.name}): resuming from it would train steps {step + 1}-{newest_step} "
                f"again. Continue with --ckpt_path last, or give --ckpt_path {given} on the command line to go "
                "back on purpose")

    def _check_data(self, data: TrainingContext, lr) -> None:
        """The manifest (bad files, null texts), the schedule against the model's context, the plan table
        (with the LR schedule ``lr``) and implied epochs."""
        manifest, schedule, cfg = data.manifest, data.schedule, data.config
        if manifest.null_texts and cfg.on_bad_shard == "error":  # not hours in, when the reader gets there
            from data.manifest import null_text_problems

            raise ConfigError("\n".join(null_text_problems(manifest.null_texts, cfg)))
        from data.plan import check_epochs, plan_table
        from data.schedules import validate_model_context

        validate_model_context(schedule, self.model.model_config.max_seq_len)
        tokenizer, vocab_size = cfg.tokenizer.build(), self.model.model_config.vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size {vocab_size:,} is smaller than data.tokenizer's vocabulary "
                              f"({tokenizer.name}: {tokenizer.vocab_size:,} ids): set model.vocab_size to at least "
                              f"{tokenizer.vocab_size} (a multiple of 128 tiles best)")
        if self.trainer.max_steps in (None, -1):  # the run length follows from the token budget
            internals.set_max_steps(self.trainer, schedule.total_steps)
        available = {n: s.stream_tokens for n, s in manifest.sources.items()}
        if self.trainer.is_global_zero:
            print(manifest.summary())
            print(plan_table(schedule, available, lr))
            print(self.model.model_config_summary())
        check_epochs(schedule, available, max_epochs=cfg.max_epochs, error=cfg.max_epochs_error)

    def _check_memory(self, data: TrainingContext, run: RunConfig) -> None:
        """On a GPU, the estimated peak of one step at the longest sequence (train/memory.py) against the
        device's memory: a micro-batch that cannot fit is refused before compute, naming the knob to turn."""
        root = self.trainer.strategy.root_device
        if root.type != "cuda" or not run.memory_check:
            return
        precision = str(self.trainer.precision)
        if precision != "bf16-mixed":
            log.warning("memory estimate: only bf16-mixed is modelled (precision %s); not checked", precision)
            return
        from train.memory import check_fits, memory_table

        seq, batch_size = data.schedule.config.seq_len.end, data.config.batch_size
        total = torch.cuda.get_device_properties(root).total_memory
        try:
            parts = check_fits(self.model.model_config, batch_size, seq, total, optim=self.model.optim)
        except ValueError as e:
            from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

            if isinstance(self.trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
                log.warning("memory estimate (for DDP; FSDP shards the parameters and optimizer state): %s", e)
                return
            raise ConfigError(f"{e}\n(run.memory_check false skips this check)") from None
        if self.trainer.is_global_zero:
            print(f"memory plan (data.batch_size {batch_size} x {seq} tokens, model.loss_impl "
                  f"{self.model.model_config.loss_impl}):\n{memory_table(parts, total)}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("WANDB_SILENT", "true")
    install_early_handlers()
    signals.FATAL_EXIT_AFTER_S = 60.0  # a fatal error ends this process within a minute (train/signals.py)
    try:
        WellMixedCLI(args=argv)
    except (WellMixedError, ModelConfigError) as e:
        print(error_lines(e), file=sys.stderr)
        return 2
    except FloatingPointError as e:  # model.on_nonfinite: stop; WeightsDiffer (the DDP ranks disagree)
        print(f"error: {e}", file=sys.stderr)
        end_worker_processes()
        return 3
    except BaseException as e:  # anything else is fatal: end the DataLoader workers, then the traceback
        pids = end_worker_processes()
        if report_lost_peers(e):  # ranks stopped answering: one line names them; train.sbatch requeues on this code
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER_LOST)  # now: the exit-time teardown of the process group can wait on the lost ranks
        if pids:
            print(f"fatal {type(e).__name__}: ended its DataLoader worker(s) {pids}", file=sys.stderr)
        raise
    return 0
