"""One configuration path: the parser ``python -m train fit`` uses, for every tool (docs/config.md).

``train fit``, ``scripts/plan.py``, launch's dry run and the ablation runner resolve their configuration
with :func:`resolve_config`, so stacked ``--config`` files and overrides mean the same everywhere and what
``fit --print_config`` shows is what each tool sees; the data-only tools use data/config.py's
:func:`~data.config.data_parser`, the same ``data:`` group without torch or Lightning. This module owns
the typed sections (``model:``, whose ``model.model`` is a :class:`~train.model.ModelConfig` group: a
model file or its fields; ``data:``; ``run:``, :class:`RunConfig`; ``trainer:``) and the parser
(:class:`WellMixedParser`: no abbreviated flags, a typo answered in one line with a "did you mean", a
``--help`` of the options users set). The resume rule is train/resume.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
import sys
import tomllib
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed
from pathlib import Path
from typing import Optional

from jsonargparse import ArgumentError, Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from data.config import (
    REMOVED_KEYS,
    DataConfig,
    config_files,
    parse_data_config,
    read_config_files,
    refuse_misread,
    removed_key_error,
)
from data.errors import ConfigError, parser_error_line
from train import lightning_internals as internals
from train.datamodule import WellMixedData
from train.model import ModelConfig
from train.module import PretrainModule

log = logging.getLogger("wellmixed")

ROOT = Path(__file__).resolve().parents[1]
# `fit --help` describes every option from its attribute docstring (the ones written under each field)
set_parsing_settings(docstring_parse_attribute_docstrings=True)


@dataclass
class RunConfig:
    """Where a run lives and how it reports (``run:`` section)."""

    dir: str = "runs/run"
    """Run directory: checkpoints/, metrics (csv/), wandb/, order_log/, config.yaml (+ config-NNN.yaml per launch).
    Every config in configs/ names its own."""
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
    allow_unverified_ckpt: bool = False
    """Resume from a checkpoint without its ``.sha256`` sidecar (a run from before checksums, or a kill
    between its rename and the sidecar), whose bytes cannot be verified; logged."""
    elastic: bool = True
    """Resume with other ranks x workers (or micro-batch, accumulation) than the checkpoint's: the old
    consumers' pending work is redistributed (exactly-once kept; the order differs; logged).
    False refuses such a resume."""
    allow_changed_data: bool = False
    """Resume although the corpus fingerprint or data.seed changed: the data order starts afresh at the
    resumed step (exactly-once is void across the change). Refused by default."""
    collective_timeout_s: float = 600.0
    """Seconds a collective (all-reduce, barrier, the checkpoint's gathers) may wait for the other ranks
    before this rank gives up: a node that vanished (power, a cut link) ends the job with one line naming
    the ranks that stopped answering, and scripts/slurm/train.sbatch requeues it. Must exceed the longest
    gap between two collectives (a checkpoint write, the first step's compile); docs/slurm.md, step 8."""
    memory_check: bool = True
    """On a GPU, refuse a micro-batch whose estimated peak memory (train/memory.py) exceeds the device."""
    allow_changed_schedule: bool = False
    """Resume although data.schedule (budget, sequence lengths, mixture) or model.lr changed: the new schedule
    applies from the resumed step (:func:`check_schedule_unchanged`). Refused by default."""
    branch: bool = False
    """A decay branch (ablations/branch.py): resume under another mixture from the checkpoint's step on,
    nothing else changed (train/resume.py ``check_branch``; logged as ``branch at step S``)."""


RESUME_POLICY = ("elastic", "allow_changed_data", "allow_changed_schedule", "branch")
"""run.* keys the DataModule is built with besides the ``data:`` section (not ``data:`` keys: refused there)."""

# -- the Trainer options: what this CLI sets itself, what --help shows ---------------------------------

SET_BY_CLI = {
    "logger": "choose loggers with --run.loggers, e.g. '[csv, tensorboard]' (csv is always written)",
    "default_root_dir": "the run directory is --run.dir",
    "val_check_interval": "held-out loss every --run.val_every_n_steps steps",
    "check_val_every_n_epoch": "held-out loss every --run.val_every_n_steps steps",
    "log_every_n_steps": "use --run.log_every_n_steps",
    "use_distributed_sampler": "the data layer slices the global order itself (data.*)",
    "enable_checkpointing": "checkpoints every --run.ckpt_every_n_steps (and --run.keep_last_k)",
    "plugins": "checkpoint IO and SLURM handling are this CLI's (train/cli.py)",
}
"""Trainer arguments this CLI sets itself: refused on the command line and in config files, naming the key
to use instead (LightningCLI would pass them on, or the CLI would overwrite them without a word)."""

TRAINER_SHOWN = ("accelerator", "devices", "num_nodes", "strategy", "precision", "accumulate_grad_batches",
                 "max_steps", "gradient_clip_val", "limit_val_batches", "num_sanity_val_steps",
                 "enable_progress_bar", "callbacks", "deterministic", "profiler", "fast_dev_run")
"""Trainer options ``--help`` describes; the others are accepted (``--trainer.NAME``) but not listed."""

HIDDEN = {"model.log_every_n_steps": "set from --run.log_every_n_steps"}
"""Other keys the CLI sets from one place (hidden from help, refused when given)."""


class WellMixedParser(LightningArgumentParser):
    """LightningCLI's parser with a ``--help`` that shows what users set. ConfigCLI makes every one with
    flags spelled out (no abbreviations: ``--data.bat 7`` is not ``--data.batch_size``) and errors raised, not
    printed with ~90 lines of usage: ConfigCLI words them (data/errors.py's ``parser_error_line``)."""

    is_command = False
    """A subcommand's parser (fit, validate), or the parser of :func:`resolve_config` (set by ConfigCLI)."""

    def format_usage(self) -> str:
        if not self.is_command:
            return super().format_usage()
        return (f"usage: {self.prog.replace(' [options]', '')} [-c CONFIG ...] [--data.KEY V] [--model.KEY V] "
                "[--run.KEY V] [--trainer.KEY V] [--ckpt_path PATH] [--print_config]\n")

    def format_help(self) -> str:
        """Data, schedule, model and run options in full; the Trainer options this CLI leaves to the user
        in one sentence each; none that it sets itself (they are refused)."""
        if not self.is_command:
            return super().format_help()
        for action in internals.parser_actions(self):
            dest = action.dest
            if dest.startswith("trainer.") and dest[len("trainer."):] not in TRAINER_SHOWN or dest in HIDDEN:
                action.help = argparse.SUPPRESS
            elif dest.startswith("trainer.") and action.help and action.help != argparse.SUPPRESS:
                action.help = re.split(r"(?<=\.)\s", action.help.strip(), maxsplit=1)[0]
        text = self.format_usage() + super().format_help().split("\n\n", 1)[1]
        text = re.sub(r",\s+known\s+subclasses:[^)]*\)", ")", text)  # Lightning's class lists
        text = re.sub(r"\n\s*ENV:\s+\S+", "", text)
        return text + (
            "\nEvery option can also be set as an environment variable: PL_<COMMAND>__<SECTION>__<KEY> (e.g. "
            "PL_FIT__DATA__SEED=7).\nOther lightning.pytorch.Trainer arguments are accepted as --trainer.NAME; "
            "these are set by this CLI and refused: " + ", ".join(f"trainer.{k}" for k in SET_BY_CLI) + ".\n")


def error_hints() -> dict[str, str]:
    """The line for a key with a known replacement: a key this CLI sets itself, a removed ``data:`` key."""
    return {**{f"trainer.{k}": f"--trainer.{k} is set by this CLI, not given: {v}" for k, v in SET_BY_CLI.items()},
            **{k: f"--{k} is set by this CLI, not given: {v}" for k, v in HIDDEN.items()},
            **{f"data.{k}": removed_key_error(k) for k in REMOVED_KEYS},
            **{f"data.{k}": f"data.{k} is a resume setting: write it as run.{k} (or --run.{k})" for k in RESUME_POLICY}}


class ConfigCLI(LightningCLI):
    """The parser of ``python -m train`` (no runtime behaviour: train/cli.py's WellMixedCLI adds that)."""

    def __init__(self, args=None, run: bool = True, prog: str | None = None, model_class: type | None = None,
                 **kwargs):
        from train import loggers as run_loggers

        self.command_parsers: list[WellMixedParser] = []  # what add_arguments_to_parser was given
        super().__init__(
            model_class or PretrainModule,
            None,  # the data: section is a DataConfig (add_arguments_to_parser); the DataModule holds it
            save_config_callback=run_loggers.RunConfigSaver,
            seed_everything_default=1234,
            # model.optim + model.lr are the module's; LightningCLI's --optimizer/--lr_scheduler would
            # silently replace both, so they are not offered
            auto_configure_optimizers=False,
            parser_class=WellMixedParser,
            # PL_FIT__TRAINER__MAX_STEPS=10 etc., as LightningCLI documents (parser_kwargs default_env)
            parser_kwargs={"prog": prog or program_name(), "default_env": True},
            args=args,
            run=run,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit and validate only: test/predict have no step in this module and crashed with a traceback."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        """Every parser spells flags out and raises its errors (:meth:`parse_arguments` words them)."""
        return super().init_parser(**{"allow_abbrev": False, "exit_on_error": False, **kwargs})

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument("--version", action="version", version=f"wellmixed {version()}")

    def add_core_arguments_to_parser(self, parser) -> None:
        """LightningCLI's ``trainer:`` and ``model:`` sections; ``data:`` is a :class:`DataConfig`, added as
        LightningCLI adds a DataModule's arguments (the DataModule is built around it: instantiate_classes)."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self.model_class, "model")
        parser.add_class_arguments(DataConfig, "data", fail_untyped=False, sub_configs=True)

    def add_arguments_to_parser(self, parser) -> None:
        parser.is_command = True
        self.command_parsers.append(parser)
        internals.wrap_config_loader(parser, "model.model", functools.partial(find_model_file, launch_dir=os.getcwd()))
        parser.add_argument("--run", type=RunConfig, default=RunConfig(), help="Run directory, logging, checkpoints.")

    def instantiate_classes(self) -> None:
        """As LightningCLI, then the DataModule built around the ``data:`` section's DataConfig and the
        resume policy of ``run:``."""
        super().instantiate_classes()
        run = (self.config_init[self.subcommand] if self.subcommand else self.config_init).run
        self.datamodule = WellMixedData(self.datamodule, **{key: getattr(run, key) for key in RESUME_POLICY})

    def _section(self):
        return self.config[self.config.subcommand] if self.config.get("subcommand") else self.config

    def parse_arguments(self, parser, args) -> None:
        """A refusal is one ConfigError line (data/errors.py's wording, shared with every tool)."""
        argv = [] if isinstance(args, (dict, Namespace)) else list(sys.argv[1:] if args is None else args)
        self.argv = argv  # the command line as given: what was asked on it, not in a config file
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as e:
            known = [k for p in self.command_parsers for k in p.get_defaults().keys()]
            raise ConfigError(parser_error_line(str(e), known, config_files(argv), error_hints())) from None
        section = self._section()
        check_config_files(section, self.command_parsers[0].get_defaults())
        refuse_set_by_cli(section)


def find_model_file(load, launch_dir: str):
    """jsonargparse reads ``model: {model: FILE}`` relative to the config file that names it; the shipped
    configs name ``configs/model/...`` from the repository root, and a copied config keeps working. So a
    FILE not found beside the config is looked for in the launch directory, then in the repository."""
    def load_model_group(value, parser):
        if isinstance(value, str) and value.endswith((".yaml", ".yml")) and not Path(value).is_file():
            found = [Path(base) / value for base in (launch_dir, ROOT) if (Path(base) / value).is_file()]
            value = str(found[0]) if found else value
        return load(value, parser)
    return load_model_group


def check_config_files(section: Namespace, defaults: Namespace) -> None:
    """What the parser lets through in a ``--config`` file, refused naming the file: a ``data.elastic`` (etc.,
    a resume setting, written under ``run:``) and what :func:`~data.config.refuse_misread` refuses."""
    for name, given in read_config_files(section):
        data = given.get("data") if isinstance(given.get("data"), dict) else {}
        for key in [k for k in RESUME_POLICY if k in data]:
            raise ConfigError(f"{name}: data.{key} is a resume setting: write it as run.{key} (or --run.{key})")
    refuse_misread(section, defaults)


def refuse_set_by_cli(section: Namespace) -> None:
    """A key this CLI sets itself (SET_BY_CLI, HIDDEN), given anyway (flag, config file or environment):
    one line naming what to use instead. Its default, or the value the CLI derives (as a saved
    ``<run>/config.yaml`` holds it), passes."""
    trainer, run = section.get("trainer") or Namespace(), section.get("run") or Namespace()
    allowed = {"logger": (None, True), "enable_checkpointing": (None, True), "use_distributed_sampler": (True, False),
               "check_val_every_n_epoch": (1, None), "val_check_interval": (None, run.get("val_every_n_steps")),
               "log_every_n_steps": (None, run.get("log_every_n_steps"))}
    for key, instead in SET_BY_CLI.items():
        value = trainer.get(key)
        if value not in allowed.get(key, (None,)):
            raise ConfigError(f"--trainer.{key} is set by this CLI (got {value!r}): {instead}")
    value = (section.get("model") or Namespace()).get("log_every_n_steps")
    if value not in (None, 1, run.get("log_every_n_steps")):
        raise ConfigError(f"--model.log_every_n_steps is set by this CLI (got {value!r}): "
                          f"{HIDDEN['model.log_every_n_steps']}")


def program_name() -> str:
    """What the usage line calls us: how the user started it, not ``__main__.py``."""
    return "wellmixed" if Path(sys.argv[0]).name == "wellmixed" else "python -m train"


def version() -> str:
    try:
        return installed("wellmixed")
    except PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# -- one resolution for every tool ---------------------------------------------------------------------


class _Resolve(ConfigCLI):
    """The parser of ``fit`` without its subcommand: its own arguments (``ckpt_path``, ``weights_only``)
    added as the subcommand adds them, so a run's saved config.yaml and ``--print_config`` are accepted, and
    the environment read under the subcommand's names (``PL_FIT__DATA__SEED``), below the config files."""

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        return super().init_parser(**{**kwargs, "env_prefix": "PL_FIT_"})

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_method_arguments(self.trainer_class, "fit", skip=set(self.subcommands()["fit"]))

    def instantiate_classes(self) -> None:  # parse only: nothing is built
        pass


def resolve_config(argv: list[str]) -> Namespace:
    """The configuration ``python -m train fit ARGV`` would run with, as ``--print_config`` shows it:
    stacked ``--config`` files and ``--data.*``/``--model.*``/``--run.*``/``--trainer.*`` overrides,
    parsed by the same parser (a bad key or value is one ConfigError line). Nothing is built."""
    argv = [a for a in argv if a != "fit"]
    quiet = logging.getLogger("lightning.fabric.utilities.seed")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():  # a tool's own flags in sys.argv are not a mistake here
            warnings.filterwarnings("ignore", "LightningCLI's args parameter")
            return _Resolve(args=argv, run=False, prog="python -m train fit").config
    finally:
        quiet.setLevel(level)


def model_config(cfg: Namespace) -> ModelConfig:
    """The :class:`ModelConfig` a resolved config builds (its ``model.model`` group)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in vars(cfg.model.model).items() if k in fields})


def data_config(cfg: Namespace) -> DataConfig:
    """The :class:`DataConfig` a resolved config builds (its ``data:`` section)."""
    return parse_data_config(cfg.data.as_dict(), origin=config_sources(cfg))


def model_source(cfg: Namespace) -> str:
    """The model file a resolved config loaded (relative to the repository when inside it), for messages."""
    path = cfg.model.model.get("__path__")
    if path is None:
        return "model.model as configured"
    absolute = Path(str(path.absolute))
    return absolute.relative_to(ROOT).as_posix() if absolute.is_relative_to(ROOT) else str(absolute)


def config_sources(cfg: Namespace) -> str:
    """The ``--config`` files of a resolved config, for messages: ``a.yaml + b.yaml``."""
    names = [str(getattr(p, "relative", p)) for p in (cfg.get("config") or [])]
    return " + ".join(names) or "(defaults)"

