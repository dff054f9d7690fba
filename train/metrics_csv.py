"""Reading a run's ``csv/metrics.csv`` (written by train.callbacks.ResumableCSVLogger) without
importing torch or Lightning: for the reports in scripts/ and ablations/."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Every row of ``RUN_DIR/csv/metrics.csv`` as a dict of strings (empty where a row lacks a key)."""
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run directory of python -m train fit?)")
    with open(path) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has ``key``, sorted by step; a resumed run's rewrite wins."""
    out = {}
    for r in rows:
        if r.get(key):
            out[int(r["step"])] = float(r[key])
    return sorted(out.items())
