"""The report of a decay-branch ablation (ablations/branch.py): each arm against the control, side by side.

``python ablations/report.py OUT`` renders it when ``OUT/branch.json`` is there (report.py gathers the
evaluations and the verdicts with the pair report's own code: ablations/evals.py, ablations/decision.py);
this module writes the sections a branch adds: the start and end of the branch per source, the tokens
each arm drew in the branch and its sources' implied epochs, the noise it was measured against, and the
cost against the from-scratch pair. It reads only files: ``branch.json`` (with the stable run's held-out
loss at the branch point), the runs' saved configs, CSV and order logs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ablations.decision import DecisionRule, Difference, Verdict, rule_table
from ablations.outcomes import BRANCHED_FROM, WALL_SECONDS, drawn_tokens, is_complete, schedule_of
from data.errors import ConfigError
from data.plan import implied_epochs
from train.rundir import read_config, read_metrics, series, tokens_per_step

CONTROL = "control"


@dataclass
class BranchComparison:
    out: Path
    plan: dict
    """``OUT/branch.json``."""
    runs: dict[str, dict[int, Path]]
    """arm -> replicate -> run directory."""
    reps: list[int]
    diffs: dict[str, dict[str, Difference]]
    """arm -> metric -> the arm against the control, paired by replicate."""
    verdicts: dict[str, Verdict]
    rule: DecisionRule
    rule_source: str
    plots: dict[str, str]


def render(c: BranchComparison) -> tuple[str, list[str]]:
    """The Markdown report and its flags (unfinished runs, arms without every replicate)."""
    flags = [f"`{c.runs[a][r].name}` is not finished (resume it: run the same ablations.branch command)"
             for a in c.runs for r in c.reps if not is_complete(c.runs[a][r])]
    expected = set(range(len(c.plan["workers"])))
    flags += [f"arm `{a}` lacks replicate(s) {sorted(expected - set(c.runs.get(a, {})))}: left out"
              for a in c.plan["arms"] if expected - set(c.runs.get(a, {}))]
    md = title(c) + (["## ⚠️ CHECKS FAILED", "", *(f"- **FLAG**: {f}" for f in flags), ""] if flags else [])
    md += verdicts(c) + heldout(c) + tokens(c) + downstream(c) + cost(c)
    return "\n".join(md), flags


def check_against_plan(out: Path, plan: dict, runs: dict[str, dict[int, Path]]) -> None:
    """Every run is the one ``branch.json`` planned: its arm's weights from the anneal start, its replicate's
    workers, its first step, and the checkpoint it started from (by sha256, one for every run); else
    refused, naming the run and what differs (a run copied from another arm would enter the verdict as
    a gain of 0)."""
    first = plan["anneal_start"] if plan.get("checkpoint_sha256") else plan["step"]  # older plans: at `step`
    starts = {}
    for arm, reps in runs.items():
        for rep, d in reps.items():
            data = read_config(d)["data"]
            weights = data["schedule"]["mixture"]["phases"][-1]["weights"]
            planned, problems = plan["arms"][arm], []
            if weights.keys() != planned.keys() or any(abs(weights[s] - w) > 1e-9 for s, w in planned.items()):
                problems.append(f"its weights from the anneal start are {weights}, the plan's {planned}")
            if rep >= len(plan["workers"]) or data.get("num_workers") != plan["workers"][rep]:
                problems.append(f"data.num_workers {data.get('num_workers')}, the plan's "
                                f"{plan['workers'][rep] if rep < len(plan['workers']) else 'none (no such replicate)'}")
            if plan.get("checkpoint_sha256") and data.get("replicate", 0) != rep:  # older plans: workers W + r
                problems.append(f"data.replicate {data.get('replicate', 0)}, not its replicate {rep}")
            steps = tokens_per_step(d)
            if steps and min(steps) != first:
                problems.append(f"its order log starts at step {min(steps)}, the branch at {first}")
            if (d / BRANCHED_FROM).is_file():
                starts[d.name] = json.loads((d / BRANCHED_FROM).read_text())["sha256"]
            if problems:
                raise ConfigError(f"{out}: run {d.name} is not the one {out}/branch.json plans: "
                                  f"{'; '.join(problems)}; rerun it (remove the folder, run the same "
                                  "ablations.branch command)")
    if plan.get("checkpoint_sha256") and not plan.get("bridge"):
        starts["the plan"] = plan["checkpoint_sha256"]
    if len(set(starts.values())) > 1:
        raise ConfigError(f"{out}: the runs started from different checkpoints (sha256 "
                          + ", ".join(f"{name} {sha[:12]}" for name, sha in sorted(starts.items()))
                          + "): rerun those that differ from the plan's")


def title(c: BranchComparison) -> list[str]:
    p = c.plan
    arms = ", ".join(f"`{a}` ({', '.join(f'{s} {w:g}' for s, w in ws.items())})" for a, ws in p["arms"].items())
    return [f"# Branch ablation report: {c.out.name}", "",
            f"Every arm branches from the stable run `{p['stable_run']}` at its checkpoint `{p['checkpoint']}` "
            f"(step {p['step']:,}; the anneal and the LR decay start at step {p['anneal_start']:,} of "
            f"{p['total_steps']:,}) and trains to the end with its own mixture from step {p['anneal_start']:,}: "
            f"{arms}. `{CONTROL}` keeps the stable weights through the decay. Model, optimizer, LR schedule and "
            "every source's data cursor carry over from the checkpoint (`--run.branch`); no document trained "
            "before the branch is trained again unless its source wraps.", "",
            f"**Noise.** {len(c.reps)} replicate(s) per arm; " + (
                "replicate r runs the branch with data.replicate r: every consumer's pending work re-seeded from "
                "r (the documents after the branch in another order, each once, the same layout and token "
                "targets; replicate 0 is the stable run's own order)" if p.get("checkpoint_sha256") else
                f"replicate r runs the branch with data.num_workers {', '.join(map(str, p['workers']))}: an "
                "elastic re-cut of the stable run's pending work (the documents after the branch in another order "
                "and interleave, each once; replicate 0 is the stable run's own order)")
            + ". The model at the branch and the held-out set are shared: the spread is the decay's "
            "data-order noise, not from-scratch seed noise. Within a replicate every arm draws each source's "
            "documents in the same order (common random numbers: the arms differ only in how much they take from "
            "each source). No held-out bootstrap (the logs keep per-source means only).", ""]


def verdicts(c: BranchComparison) -> list[str]:
    md = ["## Verdict per arm (against the control)", "",
          f"Rule (`{c.rule_source}`): {c.rule.describe()}. The gain is control − arm for a loss, arm − control "
          "for a score: positive means the arm's anneal is better; paired by replicate.", ""]
    for arm, verdict in c.verdicts.items():
        md += [f"### `{arm}`: **{verdict.outcome.upper()}**", "", *rule_table(verdict), "",
               f"![gain of {arm}]({c.plots[arm]})", ""]
    return md


def _mean(values: list[float] | None) -> str:
    if not values:
        return "–"
    return f"{np.mean(values):.4f}" + (f" ± {np.std(values, ddof=1):.4f}" if len(values) > 1 else "")


def end_values(c: BranchComparison) -> dict[str, dict[str, list[float]]]:
    """arm -> metric -> its value per replicate (the control's from any arm's comparison)."""
    ends: dict[str, dict[str, list[float]]] = {CONTROL: {}}
    for arm, diffs in c.diffs.items():
        ends[arm] = {m: d.scheduled for m, d in diffs.items()}
        ends[CONTROL].update({m: d.fixed for m, d in diffs.items()})
    return ends


def heldout(c: BranchComparison) -> list[str]:
    """Held-out loss per source at the branch point (the stable run's) and at the end, per arm."""
    ends = end_values(c)
    md = ["## Held-out loss per source: start of the branch, end", "",
          "| source | start (step) | " + " | ".join(f"end: {a}" for a in ends) + " |",
          "|---|---:|" + "---:|" * len(ends)]
    for m in [m for m in ends[CONTROL] if m.startswith("heldout/")]:
        name = m.split("/", 1)[1]
        step, value = c.plan["start"].get("val/loss" if name == "all" else f"val/loss/{name}", (0, None))
        start = "–" if value is None else f"{value:.4f} ({step:,})"
        md.append(f"| {name} | {start} | " + " | ".join(_mean(ends[a].get(m)) for a in ends) + " |")
    return md + ["", "Nats per token; the start is the stable run's last held-out loss before the branch (its step); "
                 "the end is the mean ± std over replicates.", ""]


def tokens(c: BranchComparison) -> list[str]:
    """Tokens per source each arm trained in the branch (order logs, mean over replicates) and the implied
    epochs of every source over the whole run (stable phase + branch, planned)."""
    available = c.plan["available"]
    md = ["## Tokens per source in the branch, implied epochs", "",
          "| arm | " + " | ".join(available) + " | implied epochs (" + ", ".join(available) + ") |",
          "|---|" + "---:|" * (len(available) + 1)]
    for arm, reps in c.runs.items():
        drawn = [drawn_tokens(d)[0] for d in reps.values()]
        epochs = implied_epochs(schedule_of(read_config(next(iter(reps.values())))), available)
        md.append(f"| {arm} | " + " | ".join(f"{np.mean([t.get(s, 0) for t in drawn]):,.0f}" for s in available)
                  + " | " + ", ".join(f"{epochs[s]:.2f}" for s in available) + " |")
    return md + ["", "Implied epochs: the run's planned tokens of a source over its tokens in the corpus "
                 "(above 1: the source repeats; the anneal's risk for small curated sources).", ""]


def downstream(c: BranchComparison) -> list[str]:
    rows = [(arm, m, d) for arm, diffs in c.diffs.items() for m, d in diffs.items() if not m.startswith("heldout/")]
    if not rows:
        return []
    md = ["## Downstream tasks", "", "| arm | metric | arm | control | gain |", "|---|---|---:|---:|---:|"]
    md += [f"| {arm} | {m} | {np.mean(d.scheduled):.4f} | {np.mean(d.fixed):.4f} | {d.gain:+.4f} |"
           for arm, m, d in rows]
    return md + [""]


def cost(c: BranchComparison) -> list[str]:
    """Stable tokens once, plus the branch tokens of every run, against every arm x replicate from scratch and
    against the run's budget; the wall time ``run_here`` measured, per branch and in total."""
    p = c.plan
    runs = len(p["arms"]) * len(p["workers"])
    branch = p["total_tokens"] - p["stable_tokens"]
    total, scratch = p["stable_tokens"] + runs * branch, runs * p["total_tokens"]
    md = ["## Cost", "",
          f"Stable phase once: {p['stable_tokens']:,} tokens; each branch: {branch:,} tokens "
          f"({100 * branch / p['total_tokens']:.1f}% of a run); {runs} branches: {runs * branch:,} tokens, "
          f"{100 * runs * branch / p['total_tokens']:.1f}% of the run's budget of {p['total_tokens']:,}; "
          f"{total:,} tokens in all with the stable phase. The same {len(p['arms'])} arms x {len(p['workers'])} "
          f"from scratch: {scratch:,} tokens ({total / scratch:.2f} of it)."]
    walls = [float(f.read_text()) for reps in c.runs.values() for d in reps.values()
             if (f := d / WALL_SECONDS).is_file()]
    bridge = c.out / p["bridge"].split("/")[-1] / WALL_SECONDS if p.get("bridge") else None
    if walls:
        md.append(f"Measured wall time (start-up included): {np.mean(walls):,.0f} s per branch (min "
                  f"{min(walls):,.0f}, max {max(walls):,.0f}, {len(walls)} of {runs} measured), "
                  f"{sum(walls):,.0f} s for the branches" + (f", and {float(bridge.read_text()):,.0f} s to finish "
                  f"the stable phase to step {p['anneal_start']:,} once" if bridge and bridge.is_file() else "") + ".")
    return md + [""]


def start_losses(stable_run: Path, step: int) -> dict[str, tuple[int, float]]:
    """The stable run's held-out losses logged last before ``step`` (the model the branch starts from)."""
    rows = read_metrics(stable_run)
    keys = {k for r in rows for k in r if k == "val/loss" or k.startswith("val/loss/")}
    out = {}
    for key in keys:
        points = [(st, v) for st, v in series(rows, key) if st < step]
        if points:
            out[key] = points[-1]
    return out
