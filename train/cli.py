"""``python -m train fit --config CONFIG [--ckpt_path last]``: LightningCLI over the module and the data.

Config sections: ``model:`` (train/module.py), ``data:`` (data/config.py, the DataModule),
``trainer:`` (Lightning's Trainer) and ``run:`` (below: run directory, logging, checkpoints).
Every value can be overridden from the command line, e.g. ``--data.seed 7 --run.dir runs/x``.

What this file adds to LightningCLI, and why:
- derived Trainer defaults: ``max_steps`` from the schedule's token budget, bf16-mixed on GPU and
  fp32 on CPU, validation every ``run.val_every_n_steps`` steps of the (endless) stream, no
  distributed sampler (the data layer slices the global order itself), gradient clipping 1.0;
- loggers chosen with ``run.loggers`` (train/loggers.py): CSV always, wandb (offline unless an API
  key is set), TensorBoard, MLflow; each gets the whole resolved config plus derived values.
  ``--trainer.logger`` is refused rather than ignored;
- no ``--optimizer`` / ``--lr_scheduler``: AdamW and the warmup-stable-decay LR of ``data.schedule``
  are the module's (LightningCLI's automatic optimizer flags would silently replace both);
- only the subcommands that work on this module: ``fit`` and ``validate`` (which prints its results);
- checkpoints every ``run.ckpt_every_n_steps`` plus ``last``, written atomically; what ``--ckpt_path``
  names (``last``, ``last_or_new``, a file) is found and verified before it is loaded
  (train/checkpoint.py), and SIGTERM/SIGUSR1 checkpoint and stop cleanly at the next step
  (train/faults.py); under SLURM, Lightning's own auto-requeue is off (scripts/slurm/train.sbatch
  requeues after that checkpoint);
- start-up checks before any compute: the manifest (bad files), the plan table and implied epochs,
  the schedule against the model's context, the global batch against ranks x micro-batch;
- the config is saved per launch as ``<run>/config-NNN.yaml`` (a resume adds one, never overwrites)
  and ``<run>/config.yaml`` is the latest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.environments import SLURMEnvironment

from data.errors import ConfigError, WellMixedError, error_lines
from train import faults
from train import lightning_internals as internals
from train import loggers as run_loggers
from train.callbacks import (
    AtomicCheckpointIO,
    DataStateCallback,
    FinalCheckpoint,
    ProgressLog,
    ThroughputCallback,
)
from train.checkpoint import remove_stale_temp_files, requested_hparams, resolve_checkpoint
from train.cursor_files import remove_unreferenced
from train.datamodule import WellMixedData
from train.faults import (
    StopOnSignal,
    end_worker_processes,
    install_early_handlers,
)
from train.model import ModelConfigError
from train.module import PretrainModule
from train.parallel import check_checkpoint_layout, resolve_strategy
from train.rundir import RunDir
from train.rundir_lock import acquire_run_dir

log = logging.getLogger("wellmixed")
ROOT = Path(__file__).resolve().parents[1]
# `fit --help` describes every option from its attribute docstring (the ones written under each field)
set_parsing_settings(docstring_parse_attribute_docstrings=True)


@dataclass
class RunConfig:
    """Where a run lives and how it reports (``run:`` section)."""

    dir: str = "runs/demo"
    """Run directory: checkpoints/, metrics (csv/), wandb/, order_log/, config.yaml (+ config-NNN.yaml per launch)."""
    ckpt_every_n_steps: int = 50
    """Checkpoint interval in optimizer steps (plus ``last.ckpt``, always the newest)."""
    keep_last_k: int = 3
    """Step checkpoints kept besides ``last.ckpt`` (-1 keeps all)."""
    val_every_n_steps: int = 50
    """Held-out loss per source every N steps (and at step 0 and at the end)."""
    log_every_n_steps: int = 1
    """Interval of the per-source loss reductions and logs."""
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["csv", "wandb"])
    """Loggers: csv (always written), wandb (offline unless WANDB_API_KEY is set; `wandb sync <run>/wandb`
    later), tensorboard (<run>/tensorboard), mlflow (<run>/mlruns). One not installed is an error."""
    wandb: Optional[bool] = None
    """Shorthand: true adds wandb to run.loggers, false removes it (the saved config shows the result)."""
    wandb_project: str = "wellmixed"
    """wandb project (and MLflow experiment name)."""
    wandb_group: Optional[str] = None
    """Group runs (e.g. the two arms of an ablation)."""
    wandb_name: Optional[str] = None
    """Run name in wandb / MLflow; default: the run directory's name."""
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
    memory_check: bool = True
    """On a GPU, refuse a micro-batch whose estimated peak memory (train/memory.py) exceeds the device."""
    allow_changed_schedule: bool = False
    """Resume although data.schedule (budget, LR, sequence lengths, mixture) or data.weights changed: the
    new schedule applies from the resumed step (train/faults.py). Refused by default."""


def program_name() -> str:
    """What the usage line calls us: how the user started it, not ``__main__.py``."""
    return "wellmixed" if Path(sys.argv[0]).name == "wellmixed" else "python -m train"


def project_path(path: str) -> str:
    """A relative path that does not exist here but does in the project (``configs/model/demo.yaml``
    in the shipped configs) becomes the project's, so a run works from any working directory."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not (ROOT / p).exists():
        return path
    return str(ROOT / p)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("wellmixed")
    except PackageNotFoundError:  # run from a checkout without `pip install -e .`
        import tomllib

        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def check_tokenizer() -> None:
    """The cl100k file, loaded and hash-checked in the main process before the model is built (else a
    corrupt cache file shows up as a DataLoader-worker traceback after it)."""
    from data.tokenizer import TokenizerError, get_encoding

    try:
        get_encoding()
    except TokenizerError as e:
        raise ConfigError(str(e)) from None


RESUME_POLICY = ("elastic", "allow_changed_data", "allow_changed_schedule")
"""run.* keys passed on to WellMixedData's init (jsonargparse links): `--data.<key>` is refused by the parser."""


def _refuse_linked_keys_in_files(paths) -> None:
    """A config file's ``data.elastic`` (etc.) would be overwritten by the link from ``run.elastic``
    without a word (the parser refuses only the command-line form): refuse it, naming the file."""
    import yaml

    for path in paths:
        name = str(getattr(path, "absolute", path))
        try:
            with open(name) as f:
                section = (yaml.safe_load(f) or {}).get("data") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue  # jsonargparse read it already; only a linked key is looked for here
        found = [k for k in RESUME_POLICY if isinstance(section, dict) and k in section]
        if found:
            raise ConfigError(f"{name}: data.{found[0]} is a resume setting: write it as run.{found[0]} "
                              f"(or --run.{found[0]})")


class WellMixedCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True):
        super().__init__(
            PretrainModule,
            WellMixedData,
            save_config_callback=run_loggers.RunConfigSaver,
            seed_everything_default=1234,
            # AdamW + schedule.lr(step) are the module's; LightningCLI's --optimizer/--lr_scheduler would
            # silently replace both, so they are not offered
            auto_configure_optimizers=False,
            # PL_FIT__TRAINER__MAX_STEPS=10 etc., as LightningCLI documents (parser_kwargs default_env)
            parser_kwargs={"prog": program_name(), "default_env": True},
            args=args,
            run=run,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit and validate only: test/predict have no step in this module and crashed with a traceback."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument("--version", action="version", version=f"wellmixed {version()}")

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run", type=RunConfig, default=RunConfig(), help="Run directory, logging, checkpoints.")
        for key in RESUME_POLICY:  # the DataModule's resume policy, an init argument set from run.*
            parser.link_arguments(f"run.{key}", f"data.{key}")

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's reading of ``--ckpt_path FILE``'s hparams into ``model:``, without ``_class_path``
        (our checkpoints carry it so that ``lightning.LightningModule.load_from_checkpoint`` finds the class;
        this parser is not in subclass mode and would refuse it)."""
        if not self.config.get("subcommand"):
            return
        section = self.config[self.config.subcommand]
        # refused here, before anything is built or written: see train/checkpoint.py
        hparams = requested_hparams(section.get("ckpt_path"), RunDir(section.run.dir).checkpoints,
                                    section.run.ckpt_fallback)
        hparams = {k: v for k, v in hparams.items() if k not in ("_instantiator", "_class_path")}
        if hparams:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)

    def _section(self):
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        cfg = self._section()
        tr, run = cfg.trainer, cfg.run
        _refuse_linked_keys_in_files(cfg.get("config") or [])
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
        if isinstance(cfg.model.model, str):
            cfg.model.model = project_path(cfg.model.model)
        if tr.logger not in (None, True):  # LightningCLI would pass it on; _instantiate_trainer replaces it
            raise ConfigError(f"--trainer.logger is not used by this CLI (got {tr.logger!r}): choose loggers with "
                              f"--run.loggers, e.g. '[csv, tensorboard]' (csv is always written)")
        run.loggers = run_loggers.resolve(run.loggers, run.wandb)  # the saved config shows what ran
        run.wandb = "wandb" in run.loggers
        check_tokenizer()

    def _instantiate_trainer(self, config, callbacks):
        run: RunConfig = self._section().run
        run_dir = RunDir(run.dir)
        config["default_root_dir"] = str(run_dir.root)
        config["logger"] = run_loggers.build(run.loggers, run_dir.root, wandb_project=run.wandb_project,
                                             wandb_name=run.wandb_name, wandb_group=run.wandb_group)
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
        return super()._instantiate_trainer(config, callbacks)

    def before_validate(self) -> None:
        """``--ckpt_path`` found and verified as for fit (``last`` by the step recorded inside), not by
        Lightning's own lookup of the newest file."""
        section, run = self._section(), self._section().run
        self.config_init[self.subcommand]["ckpt_path"] = resolve_checkpoint(
            section.get("ckpt_path"), RunDir(run.dir).checkpoints, run.ckpt_fallback, cursors=False)

    def before_fit(self) -> None:
        """Everything that can be wrong is checked here, before the first step."""
        dm: WellMixedData = self.datamodule
        run: RunConfig = self._section().run
        ckpt_dir = RunDir(run.dir).checkpoints
        if self.trainer.is_global_zero:  # first: nothing may touch the run dir another run holds
            acquire_run_dir(run.dir)
            internals.check_version()
        if self._section().get("ckpt_path") is None and ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
            raise ConfigError(
                f"run.dir {ckpt_dir.parent} already holds checkpoints: resume with --ckpt_path last, "
                "or choose a new --run.dir"
            )
        if self.trainer.is_global_zero:
            remove_stale_temp_files(ckpt_dir)
            remove_unreferenced(ckpt_dir)  # cursor folders of a save that was killed, or of a replaced last.ckpt
        # A checked file instead of Lightning's "last" lookup: an unreadable one is named (or skipped).
        # On several ranks only the presence of the cursor files is checked here (the same answer on
        # every rank); each rank range-checks its own file when it loads it.
        cursor_ranks = None if self.trainer.world_size == 1 else []
        ckpt_path = resolve_checkpoint(self._section().get("ckpt_path"), ckpt_dir, run.ckpt_fallback, cursor_ranks)
        self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        check_checkpoint_layout(ckpt_path, self.trainer.strategy)
        dm.prepare(self.trainer.accumulate_grad_batches)
        if self.trainer.is_global_zero:  # filter patterns -> values: logged and kept in the run dir
            from data.mapping import write_mapping_report

            write_mapping_report(dm.manifest.mapping, run.dir)
        if dm.manifest.null_texts and dm.on_bad_shard == "error":  # not hours in, when the reader gets there
            from data.manifest import null_text_problems

            raise ConfigError("\n".join(null_text_problems(dm.manifest.null_texts, dm)))
        model_ctx = self.model.model_config.max_seq_len
        if dm.steps.schedule is not None:
            from data.plan import check_epochs, plan_table
            from data.schedules import validate_model_context

            validate_model_context(dm.steps.schedule, model_ctx)
            if self.trainer.max_steps in (None, -1):  # the run length follows from the token budget
                internals.set_max_steps(self.trainer, dm.steps.schedule.total_steps)
            available = {n: s.stream_tokens for n, s in dm.manifest.sources.items()}
            if self.trainer.is_global_zero:
                print(dm.manifest.summary())
                print(plan_table(dm.steps.schedule, available))
                print(self.model.model_config_summary())
            check_epochs(dm.steps.schedule, available, max_epochs=dm.max_epochs, error=dm.max_epochs_error)
        elif dm.seq_len > model_ctx:
            raise ConfigError(f"data.seq_len ({dm.seq_len}) exceeds model max_seq_len ({model_ctx})")
        self._check_memory(dm, run)

    def _check_memory(self, dm: WellMixedData, run: RunConfig) -> None:
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

        seq = dm.steps.schedule.config.seq_len.end if dm.steps.schedule is not None else dm.seq_len
        total = torch.cuda.get_device_properties(root).total_memory
        try:
            parts = check_fits(self.model.model_config, dm.batch_size, seq, total)
        except ValueError as e:
            from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

            if isinstance(self.trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
                log.warning("memory estimate (for DDP; FSDP shards the parameters and optimizer state): %s", e)
                return
            raise ConfigError(f"{e}\n(run.memory_check false skips this check)") from None
        if self.trainer.is_global_zero:
            print(f"memory plan (data.batch_size {dm.batch_size} x {seq} tokens, model.loss_impl "
                  f"{self.model.model_config.loss_impl}):\n{memory_table(parts, total)}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("WANDB_SILENT", "true")
    install_early_handlers()
    faults.FATAL_EXIT_AFTER_S = 60.0  # a fatal error ends this process within a minute (train/faults.py)
    try:
        WellMixedCLI(args=argv)
    except (WellMixedError, ModelConfigError) as e:
        print(error_lines(e), file=sys.stderr)
        return 2
    except FloatingPointError as e:  # model.on_nonfinite: stop
        print(f"error: {e}", file=sys.stderr)
        end_worker_processes()
        return 3
    except BaseException as e:  # anything else is fatal: end the DataLoader workers, then the traceback
        pids = end_worker_processes()
        if pids:
            print(f"fatal {type(e).__name__}: ended its DataLoader worker(s) {pids}", file=sys.stderr)
        raise
    return 0
