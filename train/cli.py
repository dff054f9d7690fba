"""``python -m train fit --config CONFIG [--ckpt_path last]``: LightningCLI over the module and the data.

Config sections: ``model:`` (train/module.py), ``data:`` (data/config.py, the DataModule),
``trainer:`` (Lightning's Trainer) and ``run:`` (below: run directory, logging, checkpoints).
Every value can be overridden from the command line, e.g. ``--data.seed 7 --run.dir runs/x``.

What this file adds to LightningCLI, and why:
- derived Trainer defaults: ``max_steps`` from the schedule's token budget, bf16-mixed on GPU and
  fp32 on CPU, validation every ``run.val_every_n_steps`` steps of the (endless) stream, no
  distributed sampler (the data layer slices the global order itself), gradient clipping 1.0;
- loggers: a CSV logger (readable without wandb) and wandb, offline unless an API key is set;
- checkpoints every ``run.ckpt_every_n_steps`` plus ``last``, written atomically; the file
  ``--ckpt_path`` names is checked before it is loaded, and SIGTERM/SIGUSR1 checkpoint and stop
  cleanly at the next step (train/faults.py); under SLURM, Lightning's own auto-requeue is off
  (scripts/slurm/train.sbatch requeues after that checkpoint);
- start-up checks before any compute: the manifest (bad files), the plan table and implied epochs,
  the schedule against the model's context, the global batch against ranks x micro-batch;
- the saved ``config.yaml`` is overwritten on resume (LightningCLI refuses by default, which would
  break requeued jobs).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.environments import SLURMEnvironment

from data.errors import ConfigError
from train.callbacks import (
    AtomicCheckpointIO,
    DataStateCallback,
    FinalCheckpoint,
    ProgressLog,
    ResumableCSVLogger,
    ThroughputCallback,
    wandb_logger,
)
from train.datamodule import WellMixedData
from train.faults import StopOnSignal, install_early_handlers, remove_stale_temp_files, resolve_checkpoint
from train.model import ModelConfigError
from train.module import PretrainModule
from train.parallel import resolve_strategy

log = logging.getLogger("wellmixed")


@dataclass
class RunConfig:
    """Where a run lives and how it reports (``run:`` section)."""

    dir: str = "runs/demo"
    """Run directory: checkpoints/, metrics (csv/), wandb/, order_log/, config.yaml."""
    ckpt_every_n_steps: int = 50
    """Checkpoint interval in optimizer steps (plus ``last.ckpt``, always the newest)."""
    keep_last_k: int = 3
    """Step checkpoints kept besides ``last.ckpt`` (-1 keeps all)."""
    val_every_n_steps: int = 50
    """Held-out loss per source every N steps (and at step 0 and at the end)."""
    log_every_n_steps: int = 1
    """Interval of the per-source loss reductions and logs."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless WANDB_API_KEY is set; `wandb sync <run>/wandb` later)."""
    wandb_project: str = "wellmixed"
    wandb_group: Optional[str] = None
    """Group runs (e.g. the two arms of an ablation)."""
    wandb_name: Optional[str] = None
    print_every_n_steps: int = 25
    """A plain progress line (loss, LR, tokens/s) every N steps when no progress bar is shown (0: never)."""
    peak_flops: Optional[float] = None
    """Peak FLOP/s per device for MFU; default: 989.5e12 on H100/H200 (dense bf16), else Lightning's."""
    ckpt_fallback: bool = False
    """If the checkpoint to resume from is truncated or corrupt, use the newest valid one in
    <dir>/checkpoints (logged) instead of stopping with an error."""
    elastic: bool = True
    """Resume with other ranks x workers (or micro-batch, accumulation) than the checkpoint's: the old
    consumers' pending work is redistributed (exactly-once kept; the order differs; logged).
    False refuses such a resume."""
    allow_changed_data: bool = False
    """Resume although the corpus fingerprint or data.seed changed: the data order starts afresh at the
    resumed step (exactly-once is void across the change). Refused by default."""


class WellMixedCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True):
        super().__init__(
            PretrainModule,
            WellMixedData,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1234,
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run", type=RunConfig, default=RunConfig())

    def _section(self):
        return self.config[self.subcommand] if self.subcommand else self.config

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

    def _instantiate_trainer(self, config, callbacks):
        run: RunConfig = self._section().run
        run_dir = Path(run.dir)
        config["default_root_dir"] = str(run_dir)
        loggers = [ResumableCSVLogger(save_dir=str(run_dir), name="csv", version="")]
        if run.wandb:
            online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
            loggers.append(wandb_logger(project=run.wandb_project, name=run.wandb_name or run_dir.name,
                                        group=run.wandb_group, save_dir=str(run_dir), offline=not online))
        config["logger"] = loggers
        config["plugins"] = [AtomicCheckpointIO()]
        config["strategy"] = resolve_strategy(config.get("strategy", "auto"))  # fsdp: one unit per block
        if SLURMEnvironment.detect():
            # Lightning's auto-requeue checkpoints inside the SIGUSR1 handler, mid-step (the batch in
            # flight is lost on resume; it can hang, Lightning #21406). StopOnSignal checkpoints at the
            # next step boundary instead and scripts/slurm/train.sbatch requeues the job.
            config["plugins"].append(SLURMEnvironment(auto_requeue=False))
        callbacks = list(callbacks) + [
            DataStateCallback(str(run_dir)),
            ProgressLog(run.print_every_n_steps if config.get("enable_progress_bar") is False else 0),
            StopOnSignal(str(run_dir / "checkpoints")),  # after DataStateCallback: the cursor is recorded first
            ThroughputCallback(run.peak_flops, log_every_n_steps=run.log_every_n_steps),
            FinalCheckpoint(dirpath=str(run_dir / "checkpoints"), filename="step{step:07d}",
                            auto_insert_metric_name=False, every_n_train_steps=run.ckpt_every_n_steps,
                            save_top_k=run.keep_last_k, monitor="step", mode="max", save_last=True),
        ]
        return super()._instantiate_trainer(config, callbacks)

    def before_fit(self) -> None:
        """Everything that can be wrong is checked here, before the first step."""
        dm: WellMixedData = self.datamodule
        run: RunConfig = self._section().run
        ckpt_dir = Path(run.dir) / "checkpoints"
        if self._section().get("ckpt_path") is None and ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
            raise ConfigError(
                f"run.dir {ckpt_dir.parent} already holds checkpoints: resume with --ckpt_path last, "
                "or choose a new --run.dir"
            )
        if self.trainer.is_global_zero:
            remove_stale_temp_files(ckpt_dir)
        # A checked file instead of Lightning's "last" lookup: an unreadable one is named (or skipped).
        ckpt_path = resolve_checkpoint(self._section().get("ckpt_path"), ckpt_dir, run.ckpt_fallback)
        self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        dm.elastic, dm.allow_changed_data = run.elastic, run.allow_changed_data
        dm.prepare(self.trainer.accumulate_grad_batches)
        model_ctx = self.model.model_config.max_seq_len
        if dm.steps.schedule is not None:
            from data.plan import check_epochs, plan_table
            from data.schedules import validate_model_context

            validate_model_context(dm.steps.schedule, model_ctx)
            if self.trainer.max_steps in (None, -1):  # the run length follows from the token budget
                self.trainer.fit_loop.epoch_loop.max_steps = dm.steps.schedule.total_steps
            available = {n: s.stream_tokens for n, s in dm.manifest.sources.items()}
            if self.trainer.is_global_zero:
                print(dm.manifest.summary())
                print(plan_table(dm.steps.schedule, available))
                print(self.model.model_config_summary())
            check_epochs(dm.steps.schedule, available, max_epochs=dm.max_epochs, error=dm.max_epochs_error)
        elif dm.seq_len > model_ctx:
            raise ConfigError(f"data.seq_len ({dm.seq_len}) exceeds model max_seq_len ({model_ctx})")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("WANDB_SILENT", "true")
    install_early_handlers()
    try:
        WellMixedCLI(args=argv)
    except (ConfigError, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # model.on_nonfinite: stop
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0
