"""Evaluate a run or a checkpoint in one command: held-out loss per source, the HF export, lm-eval.

    python scripts/evaluate.py runs/demo                          # = runs/demo/checkpoints/last.ckpt
    python scripts/evaluate.py runs/demo/checkpoints/step0000300.ckpt --tasks hellaswag,arc_easy

Steps, each written under ``<run>/evals/`` (or ``--out``):

1. **Held-out loss per source** (``heldout``): the checkpoint's own model and data config
   (``PretrainModule`` / ``WellMixedData.load_from_checkpoint``) on the held-out chunks that training
   never reads (``data.val_tokens_per_source``), in nats/token with perplexities. Needs only the corpus.
2. **Export** to the Hugging Face format (train/export.py) into ``evals/hf``, with a logits check
   against ``transformers`` when it is installed.
3. **lm-evaluation-harness** (``lm_eval``), when importable, on the exported model:
   ``sys.executable -m lm_eval`` (never a PATH lookup), offline by default (``HF_DATASETS_OFFLINE``,
   ``HF_HUB_OFFLINE``), so the tasks must be cached or local (``--include-path``). Without lm-eval
   the step is skipped with the command that installs it (``pip install -e '.[eval]'``) -- checked
   first, before anything is exported.

Everything lands in ``evals/results.json`` and is printed as a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install -e '.[eval]'   (lm-eval[hf]: the harness with its transformers backend)"
STANDARD_TASKS = "hellaswag,arc_easy,piqa,lambada_openai"


def find_checkpoint(target: str | Path) -> tuple[Path, Path]:
    """(checkpoint, run directory) for a run directory (its ``checkpoints/last.ckpt``) or a ``.ckpt`` file."""
    target = Path(target)
    if target.is_dir():
        ckpt = target / "checkpoints" / "last.ckpt"
        if not ckpt.is_file():
            raise FileNotFoundError(f"{target} has no checkpoints/last.ckpt (is it a run directory?)")
        return ckpt, target
    if not target.is_file():
        raise FileNotFoundError(f"{target}: no such run directory or checkpoint")
    run_dir = target.parent.parent if target.parent.name == "checkpoints" else target.parent
    return target, run_dir


def lm_eval_available() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def heldout_loss(ckpt: Path, device: str = "cpu") -> dict[str, float]:
    """Mean loss per source (and ``all``) of the checkpoint's model on its run's held-out chunks."""
    import torch

    from train.datamodule import WellMixedData
    from train.module import PretrainModule

    saved = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)  # plain types only
    if "datamodule_hyper_parameters" not in saved or "sources" not in saved["datamodule_hyper_parameters"]:
        raise ValueError(f"{ckpt} holds no data config (written by a version before checkpoints carried it); "
                         "evaluate a checkpoint of a run trained with this version")
    del saved
    dm = WellMixedData.load_from_checkpoint(ckpt)  # builds the manifest (same held-out split as training)
    if dm.val_tokens_per_source <= 0:
        raise ValueError("the run held out no data (data.val_tokens_per_source: 0): no held-out loss to compute")
    module = PretrainModule.load_from_checkpoint(ckpt, map_location=device).eval()
    module.source_names = dm.manifest.source_names
    names = module.source_names
    sums = torch.zeros(len(names), dtype=torch.float64)
    counts = torch.zeros(len(names), dtype=torch.float64)
    with torch.no_grad():
        for batch in dm.val_dataloader():
            batch = {k: v.to(module.device) for k, v in batch.items()}
            s, c = module._per_source(module._token_losses(batch), batch["target_source"])
            sums += s.cpu()
            counts += c.cpu()
    out = {name: (sums[i] / counts[i]).item() for i, name in enumerate(names) if counts[i] > 0}
    out["all"] = (sums.sum() / counts.sum()).item()
    return out


def run_lm_eval(hf_dir: Path, tasks: str, out_dir: Path, offline: bool = True, extra: str = "") -> dict[str, float]:
    """``<task>/<metric>`` from lm-eval's results (acc, acc_norm, perplexity, word_perplexity, ...)."""
    raw = out_dir / "raw"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32",
           "--tasks", tasks, "--output_path", str(raw), *shlex.split(extra)]
    env = dict(os.environ)
    if offline:
        env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    found = sorted(raw.rglob("results*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"lm_eval wrote no results*.json under {raw}")
    metrics = {}
    for task, values in json.loads(found[-1].read_text())["results"].items():
        for key, value in values.items():
            name = key.split(",")[0]  # "acc,none" -> "acc"
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith("_stderr"):
                metrics[f"{task}/{name}"] = float(value)
    return metrics


def evaluate(target: str | Path, out: str | Path | None = None, tasks: str | None = STANDARD_TASKS,
             device: str = "cpu", offline: bool = True, lm_eval_args: str = "") -> dict[str, Any]:
    """Run the steps of the module docstring; returns (and writes) the results."""
    ckpt, run_dir = find_checkpoint(target)
    out_dir = Path(out) if out else run_dir / "evals"
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    step = int(torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    results: dict[str, Any] = {"checkpoint": str(ckpt), "step": step}
    results["heldout"] = heldout_loss(ckpt, device)
    if tasks:
        if not lm_eval_available():  # checked before the export: nothing is written for nothing
            results["lm_eval"] = {"skipped": f"lm-eval is not installed: {INSTALL_HINT}"}
        else:
            from train.export import export

            hf_dir = export(ckpt, out_dir / "hf")
            results["lm_eval"] = run_lm_eval(hf_dir, tasks, out_dir / "lm_eval", offline, lm_eval_args)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/evaluate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="run directory (uses checkpoints/last.ckpt) or a .ckpt file")
    p.add_argument("--out", help="output directory (default: <run>/evals)")
    p.add_argument("--tasks", default=STANDARD_TASKS,
                   help=f"lm-eval tasks, comma-separated (default: {STANDARD_TASKS}); '' skips lm-eval")
    p.add_argument("--device", default="cpu", help="device for the held-out loss (default: cpu)")
    p.add_argument("--online", action="store_true", help="let lm-eval download datasets (default: offline)")
    p.add_argument("--lm-eval-args", default="", help="extra lm_eval flags, e.g. '--device cuda:0 --batch_size 32'")
    args = p.parse_args(argv)
    from data.errors import ConfigError

    try:
        results = evaluate(args.target, args.out, args.tasks, args.device, not args.online, args.lm_eval_args)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"error: lm_eval failed (exit {e.returncode}); offline, its tasks must be cached or local "
              "(--include-path), or pass --online", file=sys.stderr)
        return 1
    print(format_results(results))
    return 0
