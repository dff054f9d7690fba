"""The downstream suite: a registry of evaluations, each mapping one run directory to named numbers.

The report runs every evaluation of ``--suite`` on every run and its decision rule reads the metrics
as ``<evaluation>/<metric>`` (e.g. ``heldout/curated``). Registered here (each ``@register`` says what
it is): ``heldout``, ``local`` and ``lm_eval`` (opt-in). Add one with :func:`register` (``--plugin MODULE``
imports it first); cache expensive results under ``run_dir / "evals"``. ablations/README.md ("The
downstream suite") has an example.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from data.files import write_json
from train.rundir import RunDir, read_metrics, series

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Evaluation:
    name: str
    fn: Callable[[Path], dict[str, float]]
    higher_is_better: bool = False
    description: str = ""


EVALUATIONS: dict[str, Evaluation] = {}


def register(name: str, higher_is_better: bool = False, description: str = ""):
    """Decorator: adds ``fn(run_dir) -> {metric: value}`` to the suite under ``name``."""

    def wrap(fn: Callable[[Path], dict[str, float]]):
        EVALUATIONS[name] = Evaluation(name, fn, higher_is_better, description or (fn.__doc__ or "").strip())
        return fn

    return wrap


@register("heldout", description="final held-out loss per source and overall (nats/token)")
def heldout_loss(run_dir: Path) -> dict[str, float]:
    """The newest ``val/loss/<source>`` and ``val/loss`` of the run's CSV log (its last step's)."""
    rows = read_metrics(run_dir)
    keys = sorted({k for r in rows for k, v in r.items() if v and k.startswith("val/loss/")})
    out = {}
    for key in keys + ["val/loss"]:
        points = series(rows, key)
        if points:
            out["all" if key == "val/loss" else key.split("/", 2)[2]] = points[-1][1]
    if not out:
        raise ValueError(f"{run_dir}: no val/loss in csv/metrics.csv (data.val_tokens_per_source is 0?)")
    return out


def _exported(run_dir: Path, evaluation: str) -> tuple[Path, Path]:
    """(final checkpoint, its Hugging Face export under ``<run>/evals/hf``, written once); lm-eval's
    presence is checked first, so nothing is exported for an evaluation that cannot run."""
    from train.tools.evaluate import INSTALL_HINT, find_checkpoint, lm_eval_available
    from train.tools.export import export

    if not lm_eval_available():
        raise RuntimeError(f"the {evaluation} evaluation needs lm-evaluation-harness: {INSTALL_HINT}")
    ckpt, _ = find_checkpoint(run_dir)
    hf_dir = RunDir(run_dir).evals / "hf"
    if not (hf_dir / "config.json").is_file():
        export(ckpt, hf_dir)
    return ckpt, hf_dir


@register("local", higher_is_better=True,
          description="4-way cloze accuracy per source on held-out text (offline lm-eval tasks; chance 0.25)")
def local_tasks(run_dir: Path) -> dict[str, float]:
    """``cloze_<source>`` accuracy of the run's final checkpoint on the offline tasks of the held-out chunks
    (train/tools/evaluate.py; the same items for every run), cached in ``<run>/evals/lm_eval/local/metrics.json``."""
    from train.tools.evaluate import LOCAL, load_data, run_local_tasks

    run_dir = Path(run_dir)
    cached = RunDir(run_dir).evals / "lm_eval" / LOCAL / "metrics.json"
    if not cached.is_file():
        ckpt, hf_dir = _exported(run_dir, "local")
        extra = os.environ.get("WELLMIXED_LM_EVAL_ARGS", "")
        found = run_local_tasks(load_data(ckpt), hf_dir, RunDir(run_dir).evals, extra)
        write_json(cached, {task.removeprefix("wellmixed_"): v for k, v in found.items()
                            for task, metric in [k.split("/", 1)] if task.startswith("wellmixed_cloze_")
                            and metric == "acc"})
    return json.loads(cached.read_text())


LM_EVAL_TASKS = os.environ.get("WELLMIXED_LM_EVAL_TASKS", "hellaswag,arc_easy,piqa,lambada_openai")


@register("lm_eval", higher_is_better=True,
          description=f"lm-evaluation-harness accuracy on the exported model ({LM_EVAL_TASKS})")
def lm_eval_harness(run_dir: Path) -> dict[str, float]:
    """lm-evaluation-harness (train/tools/evaluate.py, offline) on the run's exported ``checkpoints/last.ckpt``,
    cached in ``<run>/evals/lm_eval/results.json``; lm-eval's presence checked before anything is exported.
    ``$WELLMIXED_LM_EVAL_TASKS``, ``$WELLMIXED_LM_EVAL_ARGS``, ``$WELLMIXED_LM_EVAL_ONLINE=1``: README."""
    from train.tools.evaluate import run_each_task

    run_dir = Path(run_dir)
    out_dir = RunDir(run_dir).evals / "lm_eval"
    results_file = out_dir / "results.json"
    if not results_file.is_file():
        _, hf_dir = _exported(run_dir, "lm_eval")
        tasks = [t for t in LM_EVAL_TASKS.split(",") if t]
        found, skipped = run_each_task(tasks, hf_dir, out_dir, os.environ.get("WELLMIXED_LM_EVAL_ONLINE") != "1",
                                       os.environ.get("WELLMIXED_LM_EVAL_ARGS", ""))
        for task, why in skipped.items():
            print(f"note: {run_dir.name}: lm-eval task {task} skipped: {why}", file=sys.stderr)
        if not found:
            raise RuntimeError(f"{run_dir.name}: no lm-eval task of {LM_EVAL_TASKS} ran (offline, their datasets "
                               "must be in the HF cache; WELLMIXED_LM_EVAL_ONLINE=1 downloads them)")
        metrics = {k: v for k, v in found.items() if k.rsplit("/", 1)[-1] in ("acc", "acc_norm")}
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(results_file, metrics, indent=1)
    return json.loads(results_file.read_text())


