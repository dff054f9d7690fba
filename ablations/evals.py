"""The downstream suite: a registry of evaluations, each mapping one run directory to named numbers.

The report runs every evaluation of ``--suite`` on every arm and seed, takes the gain per metric
(positive: the schedule is better; ablations/report.py ``GAIN``), and its decision rule reads metrics by their full name
``<evaluation>/<metric>`` (e.g. ``heldout/curated``). Registered here:

- ``heldout`` (default): the final held-out loss per source and overall, from the run's CSV log (no
  model needed; the held-out chunks are the same for every seed and arm). Lower is better.
- ``local``: the offline downstream tasks built from the held-out chunks (train/tools/evaluate.py: a 4-way
  cloze per source), through lm-evaluation-harness on the exported model; accuracy, higher is better.
- ``lm_eval``: lm-evaluation-harness on the exported model (``scripts/export_hf.py``), opt-in: the
  standard suite, its datasets from the HF cache.

Adding one::

    from ablations.evals import register

    @register("my_suite", higher_is_better=True, description="accuracy on my tasks")
    def my_suite(run_dir: Path) -> dict[str, float]:
        ...                       # e.g. load run_dir / "checkpoints" / "last.ckpt" and score it
        return {"task_a": 0.61, "task_b": 0.47}

then ``python ablations/report.py OUT --suite heldout,my_suite --plugin mypackage.my_module`` (the
plugin module is imported first, so its ``@register`` calls run). Cache expensive results inside the
run directory (``run_dir / "evals" / ...``), as ``lm_eval`` does, so re-running the report is cheap.
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
    """``cloze_<source>`` accuracy of the run's ``checkpoints/last.ckpt`` on the offline tasks built from
    the held-out chunks (train/tools/evaluate.py ``write_local_tasks``: the same items for every arm and seed
    of one corpus and data seed); cached in ``<run>/evals/lm_eval/local/metrics.json``. Needs lm-eval,
    checked before anything is exported."""
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
    """lm-evaluation-harness on the run's exported ``checkpoints/last.ckpt``, through the one-command
    evaluation (train/tools/evaluate.py: ``sys.executable -m lm_eval``, offline, datasets from the HF cache);
    cached per run in ``<run>/evals/lm_eval/results.json``.

    Checked first: without lm-eval installed this raises, naming the install command, before anything
    is exported. Tasks from ``$WELLMIXED_LM_EVAL_TASKS`` (comma-separated), extra flags from
    ``$WELLMIXED_LM_EVAL_ARGS`` (e.g. ``--device cuda:0 --batch_size 32``); ``$WELLMIXED_LM_EVAL_ONLINE=1``
    lets the harness download datasets. Each task runs on its own: one whose dataset is not cached is
    skipped with a note (an error only when none runs). Reports ``<task>/acc`` (and ``acc_norm`` where the task has it).
    A 350M model at 2B tokens sits near chance on most of these: prefer tasks with signal at that scale,
    or use held-out loss alone.
    """
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


