"""A run directory: where ``python -m train fit`` writes, and the readers of what it wrote.

Every path of a run directory is spelled here and nowhere else::

    <run>/
      config.yaml              the resolved config of the latest launch (config-NNN.yaml: each launch's)
      csv/metrics.csv          what training and validation logged, per step (lightning_internals.ResumableCSVLogger)
      csv/eval_metrics.csv     one row per evaluated checkpoint (scripts/evaluate.py)
      checkpoints/             stepNNNNNNN.ckpt (the newest run.keep_last_k) and last.ckpt;
        cursors/stepNNNNNNN/   each rank's data cursors, one file per rank (train/cursor_files.py)
      order_log/rank<r>.jsonl  with data.order_log: one line per step and rank
      wandb/                   offline runs to `wandb sync`; wandb/run_id: the wandb run every launch logs to
      evals/                   scripts/evaluate.py: results.json, hf/, tasks/, lm_eval/
      .run.lock                held by the process training in it (train/rundir_lock.py)

The readers need neither torch nor Lightning (the reports in scripts/ and ablations/ use them), and
they read what a killed or resumed run left: the last line written for a step wins.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data.errors import ConfigError

log = logging.getLogger(__name__)


_LAYOUT = {"config": "config.yaml", "csv": "csv", "metrics_csv": "csv/metrics.csv",
           "eval_metrics_csv": "csv/eval_metrics.csv", "checkpoints": "checkpoints",
           "last_ckpt": "checkpoints/last.ckpt", "order_log_dir": "order_log", "wandb": "wandb", "evals": "evals"}


def _derived():
    return field(init=False, compare=False, repr=False)


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (``_LAYOUT``; the module docstring says what each holds)."""

    root: Path
    config: Path = _derived()
    csv: Path = _derived()
    metrics_csv: Path = _derived()
    eval_metrics_csv: Path = _derived()
    checkpoints: Path = _derived()
    last_ckpt: Path = _derived()
    order_log_dir: Path = _derived()
    wandb: Path = _derived()
    evals: Path = _derived()

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        for name, rel in _LAYOUT.items():
            object.__setattr__(self, name, self.root / rel)

    def launch_config(self, n: int) -> Path:
        return self.root / f"config-{n:03d}.yaml"

    def order_log(self, rank: int) -> Path:
        return self.order_log_dir / f"rank{rank}.jsonl"

    @classmethod
    def of_checkpoint(cls, ckpt: str | Path) -> RunDir:
        """The run a checkpoint file belongs to (``<run>/checkpoints/X.ckpt``; else the file's folder)."""
        ckpt = Path(ckpt)
        return cls(ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent)


def read_config(run_dir: str | Path) -> dict:
    """The run's saved config (``fit`` section): what it actually trained with, overrides included."""
    path = RunDir(run_dir).config
    if not path.is_file() and (RunDir(run_dir).csv / "config.yaml").is_file():  # runs before config-NNN.yaml
        path = RunDir(run_dir).csv / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run did not start")
    return yaml.safe_load(path.read_text())


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """One row per step of ``csv/metrics.csv``, sorted by step, as a dict of strings (empty where no row of
    the step has the key): see :func:`one_row_per_step`."""
    return one_row_per_step(read_csv_rows(RunDir(run_dir).metrics_csv, run_dir))


def one_row_per_step(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows of a metrics file as one row per step, whatever resumes and kills left in it.

    Within one launch steps never go back, and a step's metrics may come in several rows (training and
    validation are logged separately): those are merged, a later value of a key winning. A step lower
    than one already read is a resume: the launch trains that step and everything after it again, so
    what earlier launches logged from there on is dropped (a file written before the logger cut it at
    the resume, train/lightning_internals.py, reads as one clean run too)."""
    merged: dict[int, dict[str, str]] = {}
    last = -1
    for step, row in _stepped(rows):
        if step < last:
            merged = {s: r for s, r in merged.items() if s < step}
        last = step
        merged.setdefault(step, {}).update({k: v for k, v in row.items() if v not in (None, "")})
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: merged[s].get(k, "") for k in keys} for s in sorted(merged)]


def _stepped(rows: list[dict[str, str]]):
    """(step, row) of each row that has a step (none is written without one: such a row cannot be placed)."""
    for row in rows:
        try:
            yield int(row.get("step") or ""), row
        except ValueError:
            continue


def read_eval_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """Every row of ``csv/eval_metrics.csv`` (one per evaluated checkpoint)."""
    return read_csv_rows(RunDir(run_dir).eval_metrics_csv, run_dir)


def read_csv_rows(path: Path, run_dir: str | Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run directory of python -m train fit?)")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has ``key``, sorted by step; a resumed run's rewrite wins."""
    out = {}
    for r in rows:
        if r.get(key):
            out[int(r["step"])] = float(r[key])
    return sorted(out.items())


def read_order_log(run_dir: str | Path, required: bool = True) -> list[dict]:
    """Every (step, rank) line of the order logs, sorted; a resumed run's rewrite of a step wins.
    A run without order logs raises FileNotFoundError (``required``) or gives []."""
    files = sorted(RunDir(run_dir).order_log_dir.glob("rank*.jsonl"))
    if not files and required:
        raise FileNotFoundError(f"{RunDir(run_dir).order_log_dir}/rank*.jsonl not found: "
                                "run with --data.order_log true")
    lines: dict[tuple[int, int], dict] = {}
    for path in files:
        for d in read_jsonl(path):
            lines[(int(d["step"]), int(d["rank"]))] = d
    return [lines[k] for k in sorted(lines)]


def read_jsonl(path: Path) -> list[dict]:
    """The records of an append-only JSON-lines file (an order log), in file order. A torn last line (a
    crash while appending; its step is trained again on resume) is dropped with a warning; a line that
    does not parse before the last one is damage: ConfigError naming the file and line (docs/faults.md)."""
    texts = path.read_text().split("\n")
    out = []
    for i, text in enumerate(texts):
        if not text.strip():
            continue
        try:
            out.append(json.loads(text))
        except ValueError as e:
            if any(t.strip() for t in texts[i + 1:]):
                raise ConfigError(f"{path} line {i + 1} is not a JSON line ({e}); the file is damaged: restore it "
                                  "from a copy, or remove the line (its step then has no order-log record)") from None
            log.warning("%s: line %d is cut short (%d characters, a crash while appending it?); dropped",
                        path, i + 1, len(text))
    return out


def tokens_per_step(run_dir: str | Path) -> dict[int, dict[str, int]]:
    """Tokens per source trained at each step, summed over ranks (from the order logs)."""
    out: dict[int, dict[str, int]] = {}
    for d in read_order_log(run_dir):
        acc = out.setdefault(int(d["step"]), {})
        for source, n in d["source_tokens"].items():
            acc[source] = acc.get(source, 0) + int(n)
    return out
