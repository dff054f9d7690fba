"""One configuration path: the parser ``python -m train fit`` uses, for every tool.

``train fit``, ``scripts/plan.py``, ``scripts/dump_order.py`` and the ablation runner all resolve their
configuration with :func:`resolve_config`: the same LightningCLI/jsonargparse parser, so stacked
``--config`` files (later ones override earlier ones) and ``--data.*`` / ``--model.*`` / ``--run.*`` /
``--trainer.*`` overrides mean the same everywhere, and what ``fit --print_config`` shows is what each
tool sees.

What this module owns:

- the typed sections: ``model:`` (train/module.py's init arguments; ``model.model`` is a
  :class:`~train.model.ModelConfig` group, so ``--model.model configs/model/tiny.yaml`` loads a model
  file and ``--model.model.d_model 64`` changes one field of the model the config names), ``data:``
  (data/config.py's :class:`~data.config.DataConfig`, the DataModule's init arguments), ``run:``
  (:class:`RunConfig`) and ``trainer:`` (Lightning's Trainer);
- the parser itself (:class:`WellMixedParser`): no abbreviated flags, a typo answered with one line and
  a "did you mean", and a ``--help`` that shows the options users set (data, schedule, model, run) and
  the Trainer options this CLI does not set itself;
The resume rule (what must match a checkpoint, what may change) is train/resume.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
import sys
import tomllib
import typing
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed
from pathlib import Path
from typing import Optional

from jsonargparse import Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from data.config import REMOVED_KEYS, DataConfig, parse_data_config, removed_key_error
from data.errors import ConfigError
from data.schedules import ScheduleConfig
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
    """Resume although data.schedule (budget, LR, sequence lengths, mixture) changed: the new schedule
    applies from the resumed step (:func:`check_schedule_unchanged`). Refused by default."""
    branch: bool = False
    """A decay branch (ablations/branch.py): resume under another mixture from the checkpoint's step on,
    nothing else changed (train/resume.py ``check_branch``; logged as ``branch at step S``)."""


RESUME_POLICY = ("elastic", "allow_changed_data", "allow_changed_schedule", "branch")
"""run.* keys passed on to WellMixedData's init (jsonargparse links): `--data.<key>` is refused by the parser."""

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


def dotted_fields(cls: type, prefix: str, seen: tuple = ()) -> list[str]:
    """``prefix.field`` for every field of a (nested) dataclass: the keys of an optional dataclass
    group (``data.schedule``), which jsonargparse's help names only as a whole. A field of a type
    already on the path (``mixture.fixed_equivalent_of``) is named, not expanded."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        options = [annotation] + ([a for a in typing.get_args(annotation) if a is not type(None)]
                                  if type(None) in typing.get_args(annotation) else [])  # X or Optional[X]
        sub = next((c for c in options if isinstance(c, type) and dataclasses.is_dataclass(c)), None)
        if sub is None or sub in seen or sub is cls:
            out.append(f"{prefix}.{f.name}")
        else:
            out += dotted_fields(sub, f"{prefix}.{f.name}", (*seen, cls))
    return out


def schedule_keys() -> list[str]:
    return dotted_fields(ScheduleConfig, "data.schedule")


class WellMixedParser(LightningArgumentParser):
    """LightningCLI's parser, with flags spelled out (no abbreviations: ``--data.bat 7`` is not
    ``--data.batch_size``), a one-line error with a "did you mean" instead of ~90 lines of usage, and a
    ``--help`` that shows what users set."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    _argv: list[str] = []
    """The command line being parsed (set by ConfigCLI): the "did you mean" looks at its flags."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        self._logger.error(message)
        text = removed_key_hint(message, self._argv) or short_error(message, self)
        if "unrecognized" in text:
            text += f"; all options: {self.prog.replace(' [options]', '')} --help"
        print(f"error: {text}", file=sys.stderr)
        sys.exit(2)

    def format_usage(self) -> str:
        if not self._is_command():
            return super().format_usage()
        return (f"usage: {self.prog.replace(' [options]', '')} [-c CONFIG ...] [--data.KEY V] [--model.KEY V] "
                "[--run.KEY V] [--trainer.KEY V] [--ckpt_path PATH] [--print_config]\n")

    def format_help(self) -> str:
        """Data, schedule, model and run options in full; the Trainer options this CLI leaves to the user
        in one sentence each; none that it sets itself (they are refused)."""
        if not self._is_command():
            return super().format_help()
        for action in self._actions:
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

    def _is_command(self) -> bool:
        """A subcommand's parser (fit, validate), or the parser of :func:`resolve_config`."""
        return any(a.dest.startswith("trainer.") for a in self._actions)

    def known_keys(self) -> list[str]:
        """Every dotted option this parser (and its subcommands') accepts, the schedule's fields included."""
        keys = []
        for action in self._actions:
            keys += [o for o in action.option_strings if o.startswith("--")]
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):  # subcommands
                for sub in choices.values():
                    if isinstance(sub, WellMixedParser):
                        keys += sub.known_keys()
        return sorted(set(keys + [f"--{k}" for k in schedule_keys()]))


def removed_key_hint(message: str, argv: list[str]) -> str | None:
    """The replacement of a removed ``data:`` key (data/config.py) that a config file or flag still sets."""
    for key in REMOVED_KEYS:
        in_file = re.search(rf"(Group 'data' does not accept option '|accept option 'data\.){key}[.']", message)
        if in_file or any(re.match(rf"--data\.{key}([.=]|$)", word) for word in argv):
            return removed_key_error(key)
    return None


def short_error(message: str, parser: WellMixedParser) -> str:
    """The parser's message in a few lines: a refused Trainer key names its replacement; an unknown flag
    gets the closest known ones."""
    refused = _refused_key(message)
    if refused:
        return refused
    missing = re.search(r'Parser key "([\w.]+)": File does not exist: \'?([^\'\n]+)', message)
    if missing:
        return f"--{missing.group(1)} {missing.group(2)}: file not found"
    if "unrecognized arguments" not in message and "NestedArg" not in message:
        lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
        return re.sub(r'^Parser key "([\w.]+)":?\s*', r"--\1: ", " ".join(lines[:4]))
    unrecognized = _unknown_flag(message, parser)
    if unrecognized:
        return unrecognized
    lines = [ln for ln in message.splitlines() if ln.strip()]
    return "\n".join(lines[:6])


def _refused_key(message: str) -> str | None:
    """A key this CLI sets itself, if the message names one: what to use instead."""
    for key, instead in {**{f"trainer.{k}": v for k, v in SET_BY_CLI.items()}, **HIDDEN}.items():
        if f"--{key}" in message or f'"{key}"' in message or f"'{key}'" in message:
            return f"--{key} is set by this CLI, not given: {instead}"
    return None


def _unknown_flag(message: str, parser: WellMixedParser) -> str | None:
    """The first flag of the command line the parser does not know, with up to three close known ones."""
    words = [w for w in parser._argv if w.startswith("--")]
    known = parser.known_keys()
    unknown = [w.split("=")[0] for w in words if w.split("=")[0] not in known and w.split("=")[0] != "--help"]
    if not unknown:
        return None
    flag = unknown[0]
    close = [k for k in known if k.startswith(flag) and k != flag][:3] or \
        difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    first = message.splitlines()[0] if message else ""
    said = first if first.startswith("unrecognized arguments:") else f"unrecognized option {flag}"
    return f"{said}{hint}"


class ConfigCLI(LightningCLI):
    """The parser of ``python -m train`` (no runtime behaviour: train/cli.py's WellMixedCLI adds that)."""

    def __init__(self, args=None, run: bool = True, prog: str | None = None, model_class: type | None = None,
                 **kwargs):
        from train import loggers as run_loggers

        super().__init__(
            model_class or PretrainModule,
            WellMixedData,
            save_config_callback=run_loggers.RunConfigSaver,
            seed_everything_default=1234,
            # AdamW + schedule.lr(step) are the module's; LightningCLI's --optimizer/--lr_scheduler would
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

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument("--version", action="version", version=f"wellmixed {version()}")

    def add_arguments_to_parser(self, parser) -> None:
        model = next(a for a in parser._actions if a.dest == "model.model")
        model._load_config = _find_model_file(model._load_config)
        parser.add_argument("--run", type=RunConfig, default=RunConfig(), help="Run directory, logging, checkpoints.")
        for key in RESUME_POLICY:  # the DataModule's resume policy, an init argument set from run.*
            parser.link_arguments(f"run.{key}", f"data.{key}")

    def _section(self):
        return self.config[self.config.subcommand] if self.config.get("subcommand") else self.config

    def parse_arguments(self, parser, args) -> None:
        global _LAUNCH_DIR
        _LAUNCH_DIR = os.getcwd()
        WellMixedParser._argv = list(sys.argv[1:] if args is None else args) \
            if not isinstance(args, (dict, Namespace)) else []
        super().parse_arguments(parser, args)
        section = self._section()
        refuse_linked_keys_in_files(section.get("config") or [])
        refuse_set_by_cli(section)


_LAUNCH_DIR = os.getcwd()
"""Where the command was started: a model file named in a config file is looked for there too."""


def _find_model_file(load):
    """jsonargparse reads ``model: {model: FILE}`` relative to the config file that names it; the shipped
    configs name ``configs/model/...`` from the repository root, and a copied config keeps working. So a
    FILE not found beside the config is looked for in the launch directory, then in the repository."""
    def load_model_group(value, parser):
        if isinstance(value, str) and value.endswith((".yaml", ".yml")) and not Path(value).is_file():
            found = [Path(base) / value for base in (_LAUNCH_DIR, ROOT) if (Path(base) / value).is_file()]
            value = str(found[0]) if found else value
        return load(value, parser)
    return load_model_group


def refuse_linked_keys_in_files(paths) -> None:
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
    def instantiate_classes(self) -> None:  # parse only: nothing is built
        pass


def resolve_config(argv: list[str]) -> Namespace:
    """The configuration ``python -m train fit ARGV`` would run with, as ``--print_config`` shows it:
    stacked ``--config`` files and ``--data.*``/``--model.*``/``--run.*``/``--trainer.*`` overrides,
    parsed by the same parser (a bad key or value is one ``error:`` line, exit 2). Nothing is built."""
    argv = [a for a in argv if a != "fit"]
    saved, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when sys.argv holds arguments besides args
    quiet = logging.getLogger("lightning.fabric.utilities.seed")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        cli = _Resolve(args=argv, run=False, prog="python -m train fit")
        _PARSER[0] = cli.parser
        return cli.config
    finally:
        sys.argv = saved
        quiet.setLevel(level)


_PARSER: list = [None]


def dump_config(cfg: Namespace) -> str:
    """A config from :func:`resolve_config` as YAML, as ``--print_config`` writes it."""

    with warnings.catch_warnings():  # jsonargparse 4.49+ names it skip_unset; Lightning 2.6 still says skip_none
        warnings.simplefilter("ignore")
        return _PARSER[0].dump(cfg, skip_none=False)


def model_config(cfg: Namespace) -> ModelConfig:
    """The :class:`ModelConfig` a resolved config builds (its ``model.model`` group)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in vars(cfg.model.model).items() if k in fields})


def data_config(cfg: Namespace) -> DataConfig:
    """The :class:`DataConfig` a resolved config builds (its ``data:`` section, without the resume policy)."""
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    section = {k: v for k, v in cfg.data.as_dict().items() if k in fields}
    return parse_data_config(section, origin=config_sources(cfg))


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


def split_tool_args(own: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """A tool's command line split into its own flags (``own``'s options, with their values) and the rest,
    for :func:`resolve_config` (``--config``, ``--data.*``, ...): a configuration flag keeps the word after it
    as its value, and a bare word no flag took is one of the tool's positional arguments. The tool then parses
    its own part with ``own.parse_args`` (an unknown flag is the configuration parser's to name, with a "did
    you mean")."""
    takes_value = {o: a.nargs != 0 for a in own._actions for o in a.option_strings}
    mine, rest = [], []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token.split("=", 1)[0]
        takes_next = "=" not in token and i + 1 < len(tokens)
        if name in takes_value:
            take = 2 if takes_value[name] and takes_next else 1
            mine += tokens[i:i + take]
        elif token.startswith("-"):  # a configuration flag; its value (if any) follows it
            take = 2 if takes_next and not tokens[i + 1].startswith("--") else 1
            rest += tokens[i:i + take]
        else:  # a bare word no flag took: one of the tool's positional arguments
            take = 1
            mine.append(token)
        i += take
    return mine, rest
