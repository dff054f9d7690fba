"""Evaluate a run or a checkpoint in one command: held-out loss per source, the HF export, lm-eval.

    python scripts/evaluate.py runs/demo                          # = runs/demo/checkpoints/last.ckpt
    python scripts/evaluate.py runs/demo/checkpoints/step0000300.ckpt --tasks local,hellaswag

Steps, each written under ``<run>/evals/`` (or ``--out``); docs/training.md ("Evaluation in one command")
says what each does and where its results go:

0. :func:`plan_tasks`: which tasks will run and which are skipped, and why, before any compute.
1. **Held-out loss per source** (:func:`heldout_loss`): the checkpoint's own model and data config on the
   held-out chunks that training never reads (``data.val_tokens_per_source``).
2. **Export** to the Hugging Face format (train/tools/export.py) into ``evals/hf``.
3. **lm-evaluation-harness**, when importable, on the exported model (``sys.executable -m lm_eval``,
   offline by default): ``local`` (:func:`write_local_tasks`, built from the held-out chunks), then each
   other task one at a time (:func:`run_each_task`).

Everything lands in ``evals/results.json``, is printed as a table and, unless ``--no-log``, goes to the
run's loggers at the checkpoint's step (:func:`metrics_of`; train/loggers.py ``log_evaluation``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from data.errors import ConfigError
from data.files import write_json, write_text
from data.order import source_key
from data.reader import ShardReader
from data.types import TrainingContext
from train.rundir import RunDir

INSTALL_HINT = "pip install -e '.[eval]'   (lm-eval[hf]: the harness with its transformers backend)"
STANDARD_TASKS = "hellaswag,arc_easy,piqa,lambada_openai"
DEFAULT_TASKS = f"local,{STANDARD_TASKS}"
LOCAL = "local"
"""The name that stands for the tasks built from the run's held-out chunks (:func:`write_local_tasks`)."""
CLOZE_CONTEXT, CLOZE_CONTINUATION, CLOZE_CHOICES, CLOZE_ITEMS = 64, 24, 4, 200
"""Tokens of context and of each continuation, choices per item, items per source (at most: 200 give a
standard error of ~0.03 on an accuracy; a small held-out set gives fewer)."""
PPL_DOCS, PPL_TOKENS = 20, 1024
"""Held-out documents per source in the perplexity task, and tokens kept of each."""


@dataclass
class TaskPlan:
    """What :func:`evaluate` will do with the ``--tasks`` it was given, decided before any compute."""

    run: list[str]
    """Task names to run, in order (``local`` included)."""
    skipped: dict[str, str]
    """Task -> why it will not run."""
    notes: dict[str, str]
    """Task -> what was found for a task that runs (its dataset cached, built locally, ...)."""

    def describe(self) -> str:
        lines = ["plan: held-out loss per source" + (", then lm-eval: " + ", ".join(self.run) if self.run else
                                                      " (no lm-eval task will run)")]
        lines += [f"  run   {t}: {self.notes.get(t, '')}".rstrip(": ") for t in self.run]
        lines += [f"  skip  {t}: {why}" for t, why in self.skipped.items()]
        return "\n".join(lines)


def _lm_eval_tasks_dir() -> Path | None:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def task_dataset(task: str, tasks_dir: Path | None = None) -> str | None:
    """The ``dataset_path`` of lm-eval's task ``task`` (from its YAML, following one ``include``), or
    None when no task YAML names it (a group, a task of an ``--include_path``, a newer lm-eval)."""
    tasks_dir = tasks_dir or _lm_eval_tasks_dir()
    if tasks_dir is None or not tasks_dir.is_dir():
        return None
    named = re.compile(rf"^task:\s*['\"]?{re.escape(task)}['\"]?\s*$", re.M)
    files = _task_yamls(tasks_dir)
    for path in [p for p in files if p.stem == task] + files:  # a task's YAML is usually named after it
        text = _read(path)
        if named.search(text):
            return _dataset_path(text) or _dataset_path(_read_included(path, text))
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _dataset_path(text: str) -> str | None:
    found = re.search(r"^dataset_path:\s*['\"]?([^'\"\s#]+)", text, re.M)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=4)
def _task_yamls(tasks_dir: Path) -> list[Path]:
    return sorted(tasks_dir.rglob("*.yaml"))  # ~14,000 files in lm-eval 0.4: walked once per process


def _read_included(path: Path, text: str) -> str:
    """The YAML a task's ``include:`` names ("" without one)."""
    inc = re.search(r"^include:\s*['\"]?([^'\"\s#]+)", text, re.M)
    return _read(path.parent / inc.group(1)) if inc else ""


def dataset_cached(dataset_path: str) -> str | None:
    """Where the HF dataset ``dataset_path`` (``org/name``) is cached (the hub cache or the datasets
    cache, as ``HF_HOME`` / ``HF_HUB_CACHE`` / ``HF_DATASETS_CACHE`` place them), or None."""
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{dataset_path.replace('/', '--')}"
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets")
    built = datasets_cache / dataset_path.replace("/", "___")
    for where in (hub / "snapshots", built):
        if where.is_dir() and any(where.iterdir()):
            return str(where.parent if where.name == "snapshots" else where)
    return None


def plan_tasks(names: list[str], offline: bool = True) -> TaskPlan:
    """Which of ``names`` will run, checked before anything is computed: lm-eval installed, and
    offline, each standard task's dataset in the local HF cache (module docstring)."""
    if names and not lm_eval_available():
        return TaskPlan([], {t: f"lm-eval is not installed: {INSTALL_HINT}" for t in names}, {})
    plan = TaskPlan([], {}, {})
    for task in names:
        note = _task_note(task, offline)
        if note is None:
            plan.skipped[task] = (f"offline and its dataset {task_dataset(task)} is not in the HF cache (--online "
                                  "downloads it; or leave the task out of --tasks)")
        else:
            plan.run.append(task)
            plan.notes[task] = note
    return plan


def _task_note(task: str, offline: bool) -> str | None:
    """What was found for a task that runs; None for a task that cannot (offline, its dataset not cached)."""
    if task == LOCAL:
        return "built from the run's held-out chunks (offline)"
    dataset = task_dataset(task)
    if dataset is None:
        return "no dataset_path found for it here: lm-eval decides"
    if not offline:
        return f"{dataset} (--online: downloaded if not cached)"
    if Path(dataset).exists() or "/" not in dataset:  # a local folder or a builder such as json
        return f"{dataset} (local)"
    where = dataset_cached(dataset)
    return None if where is None else f"{dataset} cached in {where}"


EVALUATE_ANOTHER = "evaluate another checkpoint (e.g. a stepNNNNNNN.ckpt in the run's checkpoints/)"


def find_checkpoint(target: str | Path) -> tuple[Path, Path]:
    """(checkpoint, run directory) for a run directory (its last checkpoint: the ``last*.ckpt`` of the
    highest recorded step, train/checkpoint.py) or a ``.ckpt`` file, verified (a missing sidecar is a
    warning; anything else wrong a :class:`~train.checkpoint.CheckpointError`)."""
    from train.checkpoint import find_last, read_checkpoint

    target = Path(target)
    if target.is_dir() and (RunDir(target).checkpoints.is_dir() or not any(target.glob("*.ckpt"))):
        ckpt = find_last(RunDir(target).checkpoints, str(target))
        if ckpt is None:
            raise FileNotFoundError(f"{target} has no checkpoints/last.ckpt (is it a run directory?)")
        run_dir = target
    elif target.exists():
        ckpt, run_dir = target, RunDir.of_checkpoint(target).root
    else:
        raise FileNotFoundError(f"{target}: no such run directory or checkpoint")
    read_checkpoint(ckpt, "checkpoint", EVALUATE_ANOTHER)
    return ckpt, run_dir


def lm_eval_available() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def load_data(ckpt: Path) -> TrainingContext:
    """The checkpoint's prepared data: its manifest built, so the same held-out split as training."""
    from train.checkpoint import read_checkpoint
    from train.datamodule import WellMixedData

    saved = read_checkpoint(ckpt, "checkpoint", EVALUATE_ANOTHER)  # verified; tensors stay on disk
    if "datamodule_hyper_parameters" not in saved or "config" not in saved["datamodule_hyper_parameters"]:
        raise ValueError(f"{ckpt} holds no data config (written by a version before checkpoints carried it); "
                         "evaluate a checkpoint of a run trained with this version")
    del saved
    dm = WellMixedData.load_from_checkpoint(ckpt)
    data = dm.prepare()
    if data.held_out is None:
        raise ValueError("the run held out no data (data.val_tokens_per_source: 0): nothing to evaluate on")
    return data


def heldout_loss(ckpt: Path, device: str = "cpu", data: TrainingContext | None = None) -> dict[str, float]:
    """Mean loss per source (and ``all``) of the checkpoint's model on its run's held-out chunks."""
    import torch

    from train.module import PretrainModule

    data = data if data is not None else load_data(ckpt)
    module = PretrainModule.load_from_checkpoint(ckpt, map_location=device).eval()
    module.source_names = names = list(data.source_names)
    sums = torch.zeros(len(names), dtype=torch.float64)
    counts = torch.zeros(len(names), dtype=torch.float64)
    with torch.no_grad():
        for batch in data.held_out():
            batch = {k: v.to(module.device) for k, v in batch.items()}
            s, c = module.loss_per_source(batch)
            sums += s.cpu()
            counts += c.cpu()
    out = {name: (sums[i] / counts[i]).item() for i, name in enumerate(names) if counts[i] > 0}
    out["all"] = (sums.sum() / counts.sum()).item()
    return out


def held_out_documents(data: TrainingContext) -> dict[str, list[np.ndarray]]:
    """Tokens (EOT dropped) of every held-out document, per source, in the manifest's order."""
    reader = ShardReader(data.manifest, data.config)
    return {name: [t[:-1] for chunk in info.val_chunks for t in reader.read_chunk(s, chunk)[1]]
            for s, (name, info) in enumerate(data.manifest.sources.items())}


def write_local_tasks(data: TrainingContext, tasks_dir: Path) -> list[str]:
    """lm-eval tasks from the run's held-out chunks (never trained on), per source: a cloze multiple
    choice and a rolling perplexity (module docstring). Deterministic: the same files for the same
    corpus whatever the seed (the held-out chunks do not depend on it either), so every arm and seed of
    an ablation is scored on one item set. Returns the task names (a source too small for a task has none)."""
    enc = data.config.tokenizer.build()
    tasks_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for source, docs in held_out_documents(data).items():
        items = cloze_items(docs, np.random.default_rng([source_key(source), 17]), enc)  # not data.seed (above)
        if items:
            names.append(_write_task(tasks_dir, f"wellmixed_cloze_{source}", items, {
                "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
                "doc_to_target": "gold", "target_delimiter": "",
                "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                for m in ("acc", "acc_norm")]}))
        texts = [{"text": enc.decode(t[:PPL_TOKENS].tolist())} for t in docs[:PPL_DOCS] if len(t)]
        if texts:
            names.append(_write_task(tasks_dir, f"wellmixed_ppl_{source}", texts, {
                "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]}))
            # lm-eval's own (weighted) aggregations, as its wikitext task
    return names


def cloze_items(docs: list[np.ndarray], rng: np.random.Generator, enc) -> list[dict]:
    """One source's cloze items: a context window and its true continuation among other continuations of
    the source (windows round-robin over the documents: window 0 of each, then window 1, ...)."""
    window = CLOZE_CONTEXT + CLOZE_CONTINUATION
    spans = _windows(docs, window)[:CLOZE_ITEMS]
    conts = [enc.decode(docs[d][o + CLOZE_CONTEXT:o + window].tolist()) for d, o in spans]
    items = []
    for i, (d, o) in enumerate(spans):
        others = [j for j in range(len(spans)) if conts[j] != conts[i]]
        if len(others) < CLOZE_CHOICES - 1:
            continue
        picks = [conts[j] for j in rng.choice(others, CLOZE_CHOICES - 1, replace=False)]
        gold = int(rng.integers(CLOZE_CHOICES))
        picks.insert(gold, conts[i])
        items.append({"context": enc.decode(docs[d][o:o + CLOZE_CONTEXT].tolist()), "choices": picks, "gold": gold})
    return items


def _windows(docs: list[np.ndarray], window: int) -> list[tuple[int, int]]:
    """(document, offset) of every whole window, round-robin over the documents."""
    return [(d, w * window) for w in range(max((len(t) // window for t in docs), default=0))
            for d, t in enumerate(docs) if (w + 1) * window <= len(t)]


def run_local_tasks(data: TrainingContext, hf_dir: Path, out_dir: Path, extra: str = "") -> dict[str, float]:
    """The ``local`` tasks of the run (written to ``out_dir/tasks``) through lm-eval, offline."""
    names = write_local_tasks(data, out_dir / "tasks")
    return run_lm_eval(hf_dir, ",".join(names), out_dir / "lm_eval" / LOCAL, True, extra, out_dir / "tasks")


def _write_task(tasks_dir: Path, name: str, rows: list[dict], spec: dict) -> str:
    data = tasks_dir / f"{name}.jsonl"
    write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
            "test_split": "test", **spec, "metadata": {"version": 1.0}}
    write_text(tasks_dir / f"{name}.yaml", yaml.safe_dump(task, sort_keys=False))
    return name


def run_lm_eval(hf_dir: Path, tasks: str, out_dir: Path, offline: bool = True, extra: str = "",
                include_path: Path | None = None) -> dict[str, float]:
    """``<task>/<metric>`` from lm-eval's results (acc, acc_norm, perplexity, bits_per_byte, ...).

    lm-eval's output goes to ``out_dir/lm_eval.log``; a failure raises :class:`LmEvalFailed` with the
    log's last line (offline, a task whose dataset is not cached ends that way)."""
    raw = out_dir / "raw"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32",
           "--tasks", tasks, "--output_path", str(raw), *shlex.split(extra)]
    if include_path is not None:
        cmd += ["--include_path", str(include_path)]
    env = {**os.environ, **(dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
                            if offline else {})}
    log_file = out_dir / "lm_eval.log"
    print(f"$ {shlex.join(cmd)}\n  (log: {log_file})", flush=True)
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        reason = ([ln.strip() for ln in _read(log_file).splitlines() if ln.strip()] or ["no output"])[-1]
        raise LmEvalFailed(f"lm_eval --tasks {tasks} exited {proc.returncode}: {reason} (log: {log_file})", reason)
    found = sorted(raw.rglob("results*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise LmEvalFailed(f"lm_eval wrote no results*.json under {raw} (log: {log_file})", "no results")
    return _metrics(json.loads(found[-1].read_text())["results"])


def _metrics(results: dict) -> dict[str, float]:
    """``<task>/<metric>`` of every number lm-eval reports (not a standard error, not the sample length)."""
    out = {}
    for task, values in results.items():
        for key, value in values.items():
            name = key.split(",")[0]  # "acc,none" -> "acc"
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith("_stderr") \
                    and name != "sample_len":
                out[f"{task}/{name}"] = float(value)
    return out


def run_each_task(tasks: list[str], hf_dir: Path, out_dir: Path, offline: bool = True,
                  extra: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """lm-eval tasks one at a time (logs in ``out_dir/<task>/``): their metrics, and why each task that
    could not run was skipped (offline, a dataset missing from the HF cache skips only its task)."""
    found: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for task in tasks:
        try:
            found.update(run_lm_eval(hf_dir, task, out_dir / task, offline, extra))
        except LmEvalFailed as e:
            cached = offline and re.search(r"offline|couldn't reach|connection", e.reason, re.IGNORECASE)
            skipped[task] = str(e) + ("; offline, the dataset must be in the HF cache (--online downloads it)"
                                      if cached else "")
    return found, skipped


class LmEvalFailed(RuntimeError):
    """lm_eval exited non-zero or wrote no results; ``reason`` is the last line of its log."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def evaluate(target: str | Path, out: str | Path | None = None, tasks: str | None = DEFAULT_TASKS,
             device: str = "cpu", offline: bool = True, lm_eval_args: str = "", log: bool = True) -> dict[str, Any]:
    """Run the steps of the module docstring; returns (and writes) the results."""
    ckpt, run_dir = find_checkpoint(target)
    out_dir = Path(out) if out else RunDir(run_dir).evals
    out_dir.mkdir(parents=True, exist_ok=True)
    from train.checkpoint import read_checkpoint

    step = int(read_checkpoint(ckpt, "checkpoint", EVALUATE_ANOTHER).get("global_step", -1))
    results: dict[str, Any] = {"checkpoint": str(ckpt), "step": step}
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    plan = plan_tasks(names, offline)  # before any compute: say what will run and what is skipped
    print(plan.describe(), flush=True)
    data = load_data(ckpt)
    results["heldout"] = heldout_loss(ckpt, device, data)
    if names:
        results["lm_eval"] = _lm_eval_step(plan, ckpt, data, out_dir, offline, lm_eval_args)
        if plan.skipped:
            results["lm_eval_skipped"] = plan.skipped
    write_json(out_dir / "results.json", results)
    if log:
        results["logged_to"] = _log(run_dir, step, results)
        write_json(out_dir / "results.json", results)  # written before too: a logger's failure loses nothing
    return results


def _lm_eval_step(plan: TaskPlan, ckpt: Path, data: TrainingContext, out_dir: Path, offline: bool,
                  lm_eval_args: str) -> dict:
    """Step 3: the export, then the local tasks and each other task of the plan (the ones lm-eval could not
    run join ``plan.skipped``); without lm-eval, nothing is exported."""
    if not lm_eval_available():  # checked before the export: nothing is written for nothing
        return {"skipped": f"lm-eval is not installed: {INSTALL_HINT}"}
    if not plan.run:
        return {}
    from train.tools.export import export

    hf_dir = export(ckpt, out_dir / "hf")
    lm = run_local_tasks(data, hf_dir, out_dir, lm_eval_args) if LOCAL in plan.run else {}
    found, skipped = run_each_task([n for n in plan.run if n != LOCAL], hf_dir, out_dir / "lm_eval", offline,
                                   lm_eval_args)
    plan.skipped.update(skipped)
    return {**lm, **found}


def _log(run_dir: Path, step: int, results: dict) -> list[str]:
    """The results to the loggers the run trained with (train/loggers.py), where its config is found."""
    if not RunDir(run_dir).config.is_file():
        return [f"nothing: {RunDir(run_dir).config} not found (a checkpoint outside its run)"]
    from train.loggers import log_evaluation

    return log_evaluation(run_dir, step, metrics_of(results))


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """The logger keys of an evaluation: ``eval/loss`` (all sources), ``eval/loss/<source>``,
    ``eval/<task>/<metric>`` (lm-eval), beside training's ``val/loss/<source>``."""
    out = {("eval/loss" if name == "all" else f"eval/loss/{name}"): v for name, v in results["heldout"].items()}
    lm = results.get("lm_eval") or {}
    out.update({f"eval/{key}": v for key, v in lm.items() if key != "skipped"})
    return out


def format_results(results: dict[str, Any]) -> str:
    lines = [f"checkpoint {results['checkpoint']} (step {results['step']})", "",
             "| held-out source | loss (nats/token) | perplexity |", "|---|---:|---:|"]
    for name, loss in results["heldout"].items():
        lines.append(f"| {name} | {loss:.4f} | {math.exp(min(loss, 50)):.2f} |")
    lm = results.get("lm_eval")
    if lm and "skipped" in lm:
        lines += ["", f"lm-eval skipped: {lm['skipped']}"]
    elif lm:
        lines += ["", "| lm-eval task/metric | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in sorted(lm.items())]
    for task, why in results.get("lm_eval_skipped", {}).items():
        lines += [f"lm-eval {task} skipped: {why}"]
    for where in results.get("logged_to", []):
        lines += [f"logged to {where}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/evaluate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run directory (uses checkpoints/last.ckpt) or a .ckpt file")
    p.add_argument("--out", help="output directory (default: <run>/evals)")
    p.add_argument("--tasks", default=DEFAULT_TASKS,
                   help=f"lm-eval tasks, comma-separated (default: {DEFAULT_TASKS}); 'local' = the offline tasks "
                        "built from the run's held-out chunks; '' skips lm-eval")
    p.add_argument("--device", default="cpu", help="device for the held-out loss (default: cpu)")
    p.add_argument("--online", action="store_true", help="let lm-eval download datasets (default: offline)")
    p.add_argument("--lm-eval-args", default="", help="extra lm_eval flags, e.g. '--device cuda:0 --batch_size 32'")
    p.add_argument("--no-log", action="store_true",
                   help="do not send the results to the run's loggers (csv/eval_metrics.csv, its wandb run, ...)")
    args = p.parse_args(argv)
    try:
        results = evaluate(args.target, args.out, args.tasks, args.device, not args.online, args.lm_eval_args,
                           log=not args.no_log)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LmEvalFailed as e:  # the local tasks (the standard ones are skipped one by one)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0
