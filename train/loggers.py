"""The loggers a run writes to, chosen with ``run.loggers``, and what every one of them receives.

docs/training.md lists the loggers, where each writes and the metric names. ``csv`` is always written
(the reports in scripts/ and ablations/ read it); asking for a logger whose package is not installed is
an error naming the package, never a silent skip. Every logger gets the same metric names and the same
hyperparameters: the whole resolved config plus the values derived from it (:func:`derived_values`).
One run directory is one wandb run (its id kept in ``<run>/wandb/run_id``), so resumes, requeues and
:func:`log_evaluation` continue it.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
import secrets
import string
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml
from lightning.pytorch.cli import SaveConfigCallback

from data.errors import ConfigError
from data.files import refuse_link, temp_path, write_error, write_text
from train.rundir import RunDir, read_config

if TYPE_CHECKING:
    from train.architecture import Architecture

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
    wanted = {"csv": True, **dict.fromkeys(names, True), **({} if wandb is None else {"wandb": wandb})}
    out = [n for n, on in wanted.items() if on]
    missing = [n for n in out if not _installed(n)]
    if missing:
        raise ConfigError(f"run.loggers: '{missing[0]}' needs the {REQUIRES[missing[0]][1]!r} package (pip install "
                          f"{REQUIRES[missing[0]][1]}), or leave it out of run.loggers")
    return out


def _installed(name: str) -> bool:
    return name not in REQUIRES or any(importlib.util.find_spec(m) for m in REQUIRES[name][0])


def build(names: Sequence[str], run_dir: Path, *, wandb_project: str, wandb_name: str | None,
          wandb_group: str | None) -> list:
    """The Lightning loggers for ``names`` (already :func:`resolve`-d), all writing under ``run_dir``."""
    from lightning.pytorch import loggers as pl

    from train.lightning_internals import ResumableCSVLogger

    name = wandb_name or run_dir.name
    makers = {
        "csv": lambda: ResumableCSVLogger(save_dir=str(run_dir), name="csv", version=""),
        "wandb": lambda: pl.WandbLogger(project=wandb_project, name=name, group=wandb_group, save_dir=str(run_dir),
                                        offline=not wandb_online(), id=wandb_run_id(run_dir)),  # resumed ("allow")
        "tensorboard": lambda: pl.TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="",
                                                    default_hp_metric=False),
        "mlflow": lambda: pl.MLFlowLogger(experiment_name=wandb_project, run_name=name,
                                          tracking_uri=(run_dir / "mlruns").resolve().as_uri()),
    }
    return [makers[n]() for n in names]


def wandb_online() -> bool:
    """wandb logs online only with an API key and no ``WANDB_MODE=offline``: never a prompt."""
    return bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"


def wandb_run_id(run_dir: Path) -> str:
    """The wandb run id of ``run_dir``: made once, at the first launch, and kept in ``wandb/run_id``.

    Every rank calls this; the first file to land wins (a hard link never replaces), so all ranks and
    every later launch read the same id. A run directory from before this file existed keeps the id
    of its newest wandb run (``offline-run-<time>-<id>`` / ``run-<time>-<id>``).
    """
    path = RunDir(run_dir).wandb / "run_id"
    refuse_link(path, "the wandb run id file")
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = sorted(RunDir(run_dir).wandb.glob("*run-*-*"))
    if earlier:
        run_id = earlier[-1].name.rsplit("-", 1)[1]
    else:
        alphabet = string.ascii_lowercase + string.digits  # wandb's own ids: 8 characters of these
        run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    tmp = temp_path(path)
    tmp.unlink(missing_ok=True)  # never written through a link left at the temp name
    tmp.write_text(run_id + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another rank's id landed first: use it
    finally:
        tmp.unlink()
    return path.read_text().strip()


def log_evaluation(run_dir: Path, step: int, metrics: dict[str, float]) -> list[str]:
    """Send a checkpoint's evaluation (``eval/...`` metrics) to the loggers the run trained with, at the
    checkpoint's step; returns where each went. Needs the run's ``config.yaml`` (its ``run.loggers``).
    csv: ``csv/eval_metrics.csv``, one row per evaluated step (not ``metrics.csv``, which the training
    process may still be appending to); wandb: the run's own wandb run (:func:`wandb_run_id`; offline, a new
    ``offline-run-*`` folder to ``wandb sync``); tensorboard: a new event file in ``<run>/tensorboard``;
    mlflow: a run of its own, ``<run name>/eval``.
    """
    paths = RunDir(run_dir)
    run = (read_config(paths.root).get("run") or {})
    others = [n for n in (run.get("loggers") or ["csv"]) if n in KNOWN and n != "csv"]
    sent = [_write_eval_csv(paths, step, metrics)]
    sent += [f"{n}: not sent, the {REQUIRES[n][1]!r} package is not installed here" for n in others
             if not _installed(n)]
    return sent + [_send(kind, paths, run, step, metrics) for kind in filter(_installed, others)]


def _send(kind: str, paths: RunDir, run: dict, step: int, metrics: dict[str, float]) -> str:
    """Log ``metrics`` at ``step`` to a new logger of ``kind`` for the run; where they went."""
    name = run.get("wandb_name") or paths.root.name
    (logger,) = build([kind], paths.root, wandb_project=run.get("wandb_project") or "wellmixed",
                      wandb_name=f"{name}/eval" if kind == "mlflow" else name, wandb_group=run.get("wandb_group"))
    logger.log_metrics(metrics, step=step)
    logger.finalize("success")
    if kind == "wandb":
        logger.experiment.finish()
        return f"wandb: run {wandb_run_id(paths.root)} ({'online' if wandb_online() else 'offline'}), in {paths.wandb}"
    return f"{kind}: " + (str(logger.log_dir) if kind == "tensorboard" else f"run {name}/eval")


def _write_eval_csv(paths: RunDir, step: int, metrics: dict[str, float]) -> str:
    rows: dict[int, dict[str, str]] = {}
    if paths.eval_metrics_csv.is_file():
        with open(paths.eval_metrics_csv, newline="") as f:
            rows = {int(r["step"]): r for r in csv.DictReader(f)}
    rows[step] = {"step": str(step), **{k: repr(float(v)) for k, v in metrics.items()}}
    keys = ["step"] + sorted({k for r in rows.values() for k in r} - {"step"})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows[s] for s in sorted(rows))
    paths.csv.mkdir(parents=True, exist_ok=True)
    write_text(paths.eval_metrics_csv, out.getvalue())
    return f"csv: {paths.eval_metrics_csv}"


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


def derived_values(context, module, trainer) -> dict[str, Any]:
    """What follows from the config and is worth filtering runs by: run length, anneal step, planned
    tokens per source, model size, the code version."""
    from data.schedules import tokens_per_source

    out: dict[str, Any] = {}
    schedule = context.schedule  # data/types.py TrainingContext
    out["total_steps"] = schedule.total_steps
    out["total_tokens"] = schedule.total_tokens
    out["anneal_step"] = schedule.anneal_step
    out["phase_start_steps"] = {name: step for name, step in schedule.phase_boundaries}
    out["planned_tokens_per_source"] = {k: int(v) for k, v in tokens_per_source(schedule).items()}
    out["max_steps"] = trainer.max_steps
    out["world_size"] = trainer.world_size
    out["accumulate_grad_batches"] = trainer.accumulate_grad_batches
    model: Architecture = getattr(module.model, "_orig_mod", module.model)  # torch.compile wraps it
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
    paths = RunDir(run_dir)
    refuse_link(paths.config, "the run's config")
    path, created = paths.root / "config-NNN.yaml", False
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        taken = [int(p.stem[7:]) for p in paths.root.glob("config-*.yaml") if p.stem[7:].isdigit()]
        path = paths.launch_config(max(taken, default=0) + 1)
        # exclusive (O_EXCL): two launches racing for a number do not overwrite each other, a link is not followed
        with open(path, "x") as f:
            created = True
            f.write(text)
        write_text(paths.config, text)
    except OSError as e:  # out of space or inodes: one line, before the first step, and no partial file
        if created:
            path.unlink(missing_ok=True)
        raise write_error(path, e, "launch again", "nothing was trained or changed in the run directory") from e
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
        derived = derived_values(trainer.datamodule.context(), pl_module, trainer)
        hparams = _plain({**yaml.safe_load(text), "derived": derived})
        for logger in trainer.loggers:
            logger.log_hyperparams(hparams)
