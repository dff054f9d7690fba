"""The loggers a run writes to, chosen with ``run.loggers``, and what every one of them receives.

- ``csv`` is always written (``<run>/csv/metrics.csv``): the reports in scripts/ and ablations/
  read it, so a run without it could not be compared. The others are optional:
  ``wandb`` (offline unless ``WANDB_API_KEY`` is set), ``tensorboard`` (``<run>/tensorboard``)
  and ``mlflow`` (``<run>/mlruns``), each where its package is installed; asking for one that is
  not installed is an error naming the package, never a silent skip.
- Every logger gets the same metric names (``train/loss/<source>``, docs/training.md lists them)
  and the same hyperparameters: the whole resolved config (what ``--print_config`` shows) plus
  the values derived from it (:func:`derived_values`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, Sequence

import yaml
from lightning.pytorch.cli import SaveConfigCallback

from data.errors import ConfigError

log = logging.getLogger("wellmixed")

ROOT = Path(__file__).resolve().parents[1]
KNOWN = ("csv", "wandb", "tensorboard", "mlflow")
# logger -> the modules it needs (any one of them) and what to install
REQUIRES = {
    "wandb": (("wandb",), "wandb"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "mlflow": (("mlflow",), "mlflow"),
}


def resolve(names: Sequence[str], wandb: bool | None) -> list[str]:
    """The loggers to build: ``names`` with csv first, ``wandb`` added or removed by the ``run.wandb``
    shorthand (kept because every existing config and script says ``--run.wandb false``)."""
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ConfigError(f"run.loggers: unknown logger(s) {unknown}; choose from {list(KNOWN)}")
    out = ["csv"] + [n for n in dict.fromkeys(names) if n != "csv"]
    if wandb is True and "wandb" not in out:
        out.append("wandb")
    elif wandb is False and "wandb" in out:
        out.remove("wandb")
    for name in out:
        modules, package = REQUIRES.get(name, ((), ""))
        if modules and not any(importlib.util.find_spec(m) for m in modules):
            raise ConfigError(f"run.loggers: '{name}' needs the {package!r} package (pip install {package}), "
                              f"or leave it out of run.loggers")
    return out


def build(names: Sequence[str], run_dir: Path, *, wandb_project: str, wandb_name: str | None,
          wandb_group: str | None) -> list:
    """The Lightning loggers for ``names`` (already :func:`resolve`-d), all writing under ``run_dir``."""
    from train.callbacks import ResumableCSVLogger

    loggers: list = []
    for name in names:
        if name == "csv":
            loggers.append(ResumableCSVLogger(save_dir=str(run_dir), name="csv", version=""))
        elif name == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
            loggers.append(WandbLogger(project=wandb_project, name=wandb_name or run_dir.name, group=wandb_group,
                                       save_dir=str(run_dir), offline=not online))
        elif name == "tensorboard":
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="",
                                             default_hp_metric=False))
        elif name == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            loggers.append(MLFlowLogger(experiment_name=wandb_project, run_name=wandb_name or run_dir.name,
                                        tracking_uri=(run_dir / "mlruns").resolve().as_uri()))
    return loggers


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit the code ran from and whether tracked files differed from it (None outside git)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def derived_values(datamodule, module, trainer) -> dict[str, Any]:
    """What follows from the config and is worth filtering runs by: run length, anneal step, planned
    tokens per source, model size, the code version."""
    out: dict[str, Any] = {}
    schedule = datamodule.steps.schedule if datamodule.steps is not None else None
    if schedule is not None:
        from data.schedules import tokens_per_source

        out["total_steps"] = schedule.total_steps
        out["total_tokens"] = schedule.total_tokens
        out["anneal_step"] = schedule.decay_start
        out["phase_start_steps"] = {name: step for name, step in schedule.phase_boundaries}
        out["planned_tokens_per_source"] = {k: int(v) for k, v in tokens_per_source(schedule).items()}
    out["max_steps"] = trainer.max_steps
    out["world_size"] = trainer.world_size
    out["accumulate_grad_batches"] = trainer.accumulate_grad_batches
    model = getattr(module.model, "_orig_mod", module.model)
    out["parameters"] = model.num_params()
    out["parameters_non_embedding"] = model.num_params(non_embedding=True)
    out["model_config"] = dict(vars(module.model_config))
    out.update(git_state())
    return out


def _plain(value: Any) -> Any:
    """YAML/JSON-safe values for loggers (tuples as lists, paths as strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def save_launch_config(run_dir: Path, text: str) -> Path:
    """``<run>/config-NNN.yaml`` for this launch (NNN counts launches: a resume never overwrites the
    config a run started with) and ``config.yaml``, replaced atomically, for the latest one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    taken = [int(p.stem[7:]) for p in run_dir.glob("config-*.yaml") if p.stem[7:].isdigit()]
    path = run_dir / f"config-{max(taken, default=0) + 1:03d}.yaml"
    with open(path, "x") as f:  # exclusive: two launches racing for a number do not overwrite each other
        f.write(text)
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, run_dir / "config.yaml")
    return path


class RunConfigSaver(SaveConfigCallback):
    """LightningCLI's SaveConfigCallback, reworked: the config goes to the run directory once per launch
    (:func:`save_launch_config`) and, with :func:`derived_values`, to every logger's hyperparameters.

    The module and DataModule save their init arguments with ``logger=False``, so this is the only
    source of hyperparameters a logger sees: the same keys in wandb, TensorBoard, MLflow and
    ``csv/hparams.yaml``.
    """

    def __init__(self, parser, config, **kwargs):
        super().__init__(parser, config, **{**kwargs, "save_to_log_dir": False})

    def save_config(self, trainer, pl_module, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False, format="yaml")
        path = save_launch_config(Path(self.config.run.dir), text)
        log.info("config saved to %s (and config.yaml)", path)
        hparams = _plain({**yaml.safe_load(text), "derived": derived_values(trainer.datamodule, pl_module, trainer)})
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)
