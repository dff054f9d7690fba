"""Compare the arms of an ablation from their logs and write ``OUT/report.md`` with its plots.

    python ablations/report.py runs/ablation-demo
    python ablations/report.py runs/ablation-350m_2b --improve heldout/curated --max-regression 0.02
    python ablations/report.py runs/branch-demo          # a decay-branch ablation (OUT/branch.json)

A pair (``OUT/<arm>-seed<S>``, arms ``scheduled`` and ``fixed``): the verdict of the decision rule
(ablations/decision.py), the tokens per source each arm drew (equal up to the documents in flight, else
FLAGGED), held-out loss per source, the other evaluations of ``--suite``, three PNGs. A decay-branch
ablation (``OUT/<arm>-rep<R>``): each arm against the control (ablations/branch_report.py). Only files
are read; ablations/README.md describes every section.

One sign convention throughout, :data:`GAIN`: positive means the schedule (the arm) is better. Exit
status 1 when a check fails (tokens not equal, a run unfinished, an arm missing); the decision itself
never changes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ablations.branch_report import CONTROL, BranchComparison, check_against_plan
from ablations.branch_report import render as render_branch
from ablations.decision import DecisionRule, Difference, Verdict, decide, rule_table
from ablations.evals import EVALUATIONS, Evaluation
from ablations.outcomes import (
    config_differences,
    drawn_tokens,
    final_mixer_state,
    is_complete,
    planned_tokens,
    schedule_of,
)
from data.errors import ConfigError, one_line_errors
from data.files import atomic_path, write_text
from data.plotting import source_colors
from train.rundir import RunDir, read_config, read_metrics, series, tokens_per_step

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("scheduled", "fixed")
ARM_KEYS = ("data.schedule.mixture", "run.dir", "run.wandb_name", "ckpt_path")
"""Config keys the arms may differ in; any other difference in their saved configs is flagged."""
RUN_DIR = re.compile(r"^(.+)-(?:seed|rep)(\d+)$")
"""``<arm>-seed<S>`` (a pair, ablations/run.py) or ``<arm>-rep<R>`` (a decay branch, ablations/branch.py)."""
PLANNED_RTOL = 1e-6
DEFAULT_RULE = ROOT / "ablations" / "decision_rule.yaml"
GAIN = ("gain = fixed - scheduled for a loss, scheduled - fixed for a score (accuracy): "
        "positive means the schedule is better")
"""The one sign convention of the report, its tables and its plots (stated once, at the top)."""


# -- tokens per source -----------------------------------------------------------------------------
@dataclass
class TokenRow:
    source: str
    planned: float
    scheduled: int
    fixed: int
    tolerance: float
    in_flight: tuple[int | None, int | None]
    target: tuple[float | None, float | None]

    @property
    def delta(self) -> int:
        return self.scheduled - self.fixed

    @property
    def ok(self) -> bool:
        return abs(self.delta) <= self.tolerance


@dataclass
class TokenCheck:
    seed: int
    rows: list[TokenRow]
    planned_equal: bool
    planned: tuple[dict[str, float], dict[str, float]]
    steps: tuple[int, int]

    @property
    def targets_equal(self) -> bool | None:
        """Whether the mixers aimed at the same tokens per source (None without both checkpoints)."""
        if any(None in r.target for r in self.rows):
            return None
        return all(abs(r.target[0] - r.target[1]) <= PLANNED_RTOL * max(r.target[0], 1.0) for r in self.rows)

    @property
    def ok(self) -> bool:
        return (self.planned_equal and self.targets_equal is not False and all(r.ok for r in self.rows)
                and self.steps[0] == self.steps[1])


def check_tokens(seed: int, runs: dict[str, Path], rtol: float, atol: float | None) -> TokenCheck:
    """Planned, targeted and drawn tokens per source of one seed's two arms."""
    configs = {arm: read_config(runs[arm]) for arm in ARMS}
    planned = {arm: planned_tokens(configs[arm]) for arm in ARMS}
    sources = list(planned["scheduled"])
    planned_equal = set(planned["fixed"]) == set(sources) and all(
        abs(planned["scheduled"][s] - planned["fixed"][s]) <= PLANNED_RTOL * max(planned["scheduled"][s], 1.0)
        for s in sources)
    drawn, steps = {}, {}
    for arm in ARMS:
        drawn[arm], steps[arm] = drawn_tokens(runs[arm])
    mixers = {arm: final_mixer_state(runs[arm], list(configs[arm]["data"]["sources"])) for arm in ARMS}
    if atol is None:
        sched = configs["scheduled"]["data"]["schedule"]
        atol = float(sched["global_batch_size"] * sched["seq_len"]["end"])
    rows = []
    for s in sources:
        final = [None if mixers[a] is None or mixers[a].step != steps[a] else mixers[a] for a in ARMS]
        rows.append(TokenRow(s, planned["scheduled"][s], drawn["scheduled"].get(s, 0), drawn["fixed"].get(s, 0),
                             max(rtol * planned["scheduled"][s], atol),
                             tuple(None if m is None else m.in_flight.get(s) for m in final),
                             tuple(None if m is None else m.target.get(s) for m in final)))
    return TokenCheck(seed, rows, planned_equal, (planned["scheduled"], planned["fixed"]),
                      (steps["scheduled"], steps["fixed"]))


# -- the report ----------------------------------------------------------------------------------
def discover(out: Path) -> dict[str, dict[int, Path]]:
    runs: dict[str, dict[int, Path]] = {arm: {} for arm in ARMS}
    for d in sorted(out.iterdir()) if out.is_dir() else []:
        m = RUN_DIR.match(d.name)
        if m and RunDir(d).metrics_csv.is_file():
            runs.setdefault(m.group(1), {})[int(m.group(2))] = d
    return runs


def default_suite(out: Path) -> str:
    """``heldout,local`` where lm-eval is installed and every run has its final checkpoint (or the local
    tasks' cached results), else ``heldout`` with a note saying why."""
    from train.tools.evaluate import INSTALL_HINT, LOCAL, lm_eval_available

    if not lm_eval_available():
        print(f"note: the offline downstream tasks (--suite heldout,local) need lm-eval: {INSTALL_HINT}",
              file=sys.stderr)
        return "heldout"
    dirs = [d for arm in discover(out).values() for d in arm.values()]
    missing = [d.name for d in dirs if not RunDir(d).last_ckpt.is_file()
               and not (RunDir(d).evals / "lm_eval" / LOCAL / "metrics.json").is_file()]
    if missing:
        print(f"note: no checkpoints/last.ckpt in {', '.join(missing)}: the offline downstream tasks are left out "
              "(--suite heldout)", file=sys.stderr)
        return "heldout"
    return "heldout,local"


def evaluate(suite: list[Evaluation], runs: dict[str, dict[int, Path]], seeds: list[int],
             arms: tuple[str, str] = ARMS) -> dict[str, Difference]:
    """Every metric of the suite, ``arms[0]`` (the treatment) against ``arms[1]`` (the baseline), paired by seed."""
    diffs: dict[str, Difference] = {}
    for ev in suite:
        treated, base = ([ev.fn(runs[arm][seed]) for seed in seeds] for arm in arms)
        for name in [k for k in treated[0] if all(k in r for r in treated + base)]:
            diffs[f"{ev.name}/{name}"] = Difference(f"{ev.name}/{name}", [r[name] for r in treated],
                                                    [r[name] for r in base], ev.higher_is_better)
    return diffs


def fmt_tokens(x: float) -> str:
    return f"{x:,.0f}"


def pm(mean: float, std: float, digits: int = 4) -> str:
    return f"{mean:+.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def mixture_text(config: dict) -> str:
    mix = config["data"]["schedule"]["mixture"]
    if mix.get("fixed_equivalent_of"):
        sched = schedule_of(config)
        w = dict(zip(sched.sources, sched.phase_weights[0]))
        return "fixed equivalent of the phases: " + ", ".join(f"{s} {v:.4f}" for s, v in w.items())
    if mix.get("weights"):
        return "fixed: " + ", ".join(f"{s} {v:g}" for s, v in mix["weights"].items())
    return "phases: " + "; ".join(
        f"{p['name']} from {p.get('start', 0)}: " + ", ".join(f"{s} {v:g}" for s, v in p["weights"].items())
        for p in mix["phases"])


def build_report(out: Path, rule: DecisionRule, suite: list[Evaluation], rtol: float,
                 atol: float | None, rule_source: str = "ablations/decision_rule.yaml") -> tuple[str, bool]:
    """The Markdown report (plots written next to it) and whether every check passed."""
    runs = discover(out)
    seeds = paired_seeds(out, runs)
    flags = unpaired_flags(runs, seeds) + unfinished_flags(runs, seeds) + config_flags(runs, seeds)
    checks = [check_tokens(seed, {arm: runs[arm][seed] for arm in ARMS}, rtol, atol) for seed in seeds]
    flags += [flag for check in checks for flag in token_flags(check)]
    diffs = evaluate(suite, runs, seeds)
    verdict = decide(rule, diffs)
    configs = {arm: read_config(runs[arm][seeds[0]]) for arm in ARMS}
    schedule = schedule_of(configs["scheduled"])

    plots = write_plots(out, runs, seeds, diffs, rule, schedule.anneal_step, verdict)
    md = render(Comparison(out, seeds, runs, configs, schedule, flags, checks, diffs, rule, verdict, suite, plots,
                           rtol, atol, rule_source))
    return md, not flags


def build_branch_report(out: Path, rule: DecisionRule, suite: list[Evaluation],
                        rule_source: str) -> tuple[str, bool]:
    """A decay-branch ablation's report (ablations/branch_report.py): each arm against the control."""
    plan = json.loads((out / "branch.json").read_text())
    runs, reps = branch_runs(out, plan)
    check_against_plan(out, plan, runs)
    diffs = {arm: evaluate(suite, runs, reps, (arm, CONTROL)) for arm in runs if arm != CONTROL}
    verdicts = {arm: decide(rule, d, arms=len(diffs)) for arm, d in diffs.items()}
    plots = {arm: _save(end_figure(diffs[arm], rule, verdicts[arm], len(reps)), out / f"heldout_end_{arm}.png")
             for arm in diffs}
    md, flags = render_branch(BranchComparison(out, plan, runs, reps, diffs, verdicts, rule, rule_source, plots))
    return md, not flags


def branch_runs(out: Path, plan: dict) -> tuple[dict[str, dict[int, Path]], list[int]]:
    """The branch ablation's runs (arm -> replicate -> directory) and the replicates every arm has."""
    runs = {arm: reps for arm, reps in discover(out).items() if reps and arm in plan["arms"]}
    if CONTROL not in runs or len(runs) < 2:
        raise ConfigError(f"{out} holds no control-rep<R>/ and <arm>-rep<R>/ runs with csv/metrics.csv yet "
                          "(run python -m ablations.branch first)")
    return runs, sorted(set.intersection(*(set(r) for r in runs.values())))


def paired_seeds(out: Path, runs: dict[str, dict[int, Path]]) -> list[int]:
    """The seeds both arms ran; an error when there is none."""
    seeds = sorted(set(runs["scheduled"]) & set(runs["fixed"]))
    if not seeds:
        raise ConfigError(f"{out} holds no pair of scheduled-seed<S>/ and fixed-seed<S>/ run directories "
                          "with csv/metrics.csv (run ablations/run.py first)")
    return seeds


def unpaired_flags(runs: dict[str, dict[int, Path]], seeds: list[int]) -> list[str]:
    """A flag per run whose seed the other arm did not run (it is left out)."""
    return [f"`{runs[arm][seed].name}` has no counterpart in the other arm: left out"
            for arm in ARMS for seed in sorted(set(runs[arm]) - set(seeds))]


def unfinished_flags(runs: dict[str, dict[int, Path]], seeds: list[int]) -> list[str]:
    """A flag per paired run that has not trained its whole schedule."""
    return [f"`{runs[arm][seed].name}` is not finished: its last held-out loss predates the end "
            "of the schedule (resume it: re-run ablations/run.py with the same arguments)"
            for seed in seeds for arm in ARMS if not is_complete(runs[arm][seed])]


def config_flags(runs: dict[str, dict[int, Path]], seeds: list[int]) -> list[str]:
    """A flag per seed whose arms' saved configs differ in more than :data:`ARM_KEYS`."""
    flags = []
    for seed in seeds:
        differ = config_differences(*(read_config(runs[arm][seed]) for arm in ARMS), allowed=ARM_KEYS)
        if differ:
            flags.append(f"seed {seed}: the arms' configs differ in more than the mixture: "
                         + ", ".join(f"`{k}`" for k in differ))
    return flags


def token_flags(check: TokenCheck) -> list[str]:
    """The failed parts of one seed's token check: plan, mixer targets, steps, tokens drawn."""
    seed, flags = check.seed, []
    if not check.planned_equal:
        flags.append(f"seed {seed}: the arms were configured for DIFFERENT tokens per source (planned "
                     f"scheduled {_short(check.planned[0])} vs fixed {_short(check.planned[1])}): the fixed arm "
                     "must be `mixture: {fixed_equivalent_of: <the scheduled phases>}` over the same budget")
    if check.targets_equal is False:
        flags.append(f"seed {seed}: the arms' mixers aimed at DIFFERENT tokens per source over the tokens they "
                     "trained (final checkpoints' cursors)")
    if check.steps[0] != check.steps[1]:
        flags.append(f"seed {seed}: the arms trained different numbers of steps "
                     f"({check.steps[0]} vs {check.steps[1]})")
    bad = [r for r in check.rows if not r.ok]
    if bad:
        flags.append(f"seed {seed}: tokens drawn per source DIFFER beyond the tolerance for "
                     + ", ".join(f"{r.source} ({r.delta:+,d} tokens, {100 * r.delta / max(r.planned, 1):+.1f}% "
                                 f"of plan; tolerance {fmt_tokens(r.tolerance)})" for r in bad))
    return flags


@dataclass
class Comparison:
    """Everything the report shows, gathered by :func:`build_report` and written out by :func:`render`."""

    out: Path
    seeds: list[int]
    runs: dict[str, dict[int, Path]]  # arm -> seed -> run directory
    configs: dict[str, dict]  # arm -> its first seed's saved config
    schedule: Any
    flags: list[str]  # failed checks, one line each
    checks: list  # TokenCheck per seed
    diffs: dict[str, Difference]
    rule: DecisionRule
    verdict: Verdict
    suite: list[Evaluation]
    plots: dict[str, str]
    rtol: float
    atol: float | None
    rule_source: str = "ablations/decision_rule.yaml"


def _short(tokens: dict[str, float]) -> str:
    return "{" + ", ".join(f"{s}: {fmt_tokens(v)}" for s, v in tokens.items()) + "}"


def render(c: Comparison) -> str:
    """The report's Markdown, one section after another (each section's lines end with a blank line)."""
    sections = (title_section, flags_section, verdict_section, setup_section, tokens_section, heldout_end_section,
                along_run_section, downstream_section)
    return "\n".join(line for section in sections for line in section(c))


def title_section(c: Comparison) -> list[str]:
    name = c.configs["scheduled"]["run"].get("wandb_group") or c.out.name
    shown = os.path.relpath(c.out) if Path(c.out).resolve().is_relative_to(Path.cwd()) else str(c.out)
    return [f"# Ablation report: {name}", "",
            f"Scheduled vs fixed mixture, {len(c.seeds)} seed(s) ({', '.join(map(str, c.seeds))}), "
            f"from the logs in `{shown}` (`python ablations/report.py {shown}`).", ""]


def flags_section(c: Comparison) -> list[str]:
    """The failed checks, at the top; nothing when every check passed."""
    if not c.flags:
        return []
    return ["## ⚠️ CHECKS FAILED: this is not a valid comparison", "", *(f"- **FLAG**: {f}" for f in c.flags), ""]


def verdict_section(c: Comparison) -> list[str]:
    """The decision, the rule, the sign convention and the rule's inputs (ablations/decision.py)."""
    md = ["## Verdict", "",
          f"**{c.verdict.headline}**" + (" — but see the failed checks above" if c.flags else "") + ".", "",
          f"Rule (`{c.rule_source}`): {c.rule.describe()}.", "",
          f"Every table and plot of this report shows the {GAIN}. SE = standard error of the mean gain "
          "over the paired seeds.", "",
          *rule_table(c.verdict), "",
          *(f"- {line}" for line in c.verdict.lines)]
    if len(c.seeds) < c.rule.min_seeds:
        md.append(f"- {len(c.seeds)} seed(s): no estimate of the seed noise, so no decision; run "
                  "`ablations/run.py --num-seeds 3` (the default) to tell small differences from noise")
    return md + [""]


def setup_section(c: Comparison) -> list[str]:
    """Each arm's mixture and schedule."""
    md = ["## Setup", "",
          "| arm | mixture | steps | tokens | anneal + LR decay from step |",
          "|---|---|---|---|---|"]
    for arm in ARMS:
        s = schedule_of(c.configs[arm])
        md.append(f"| {arm} | {mixture_text(c.configs[arm])} | {s.total_steps:,} | {fmt_tokens(s.total_tokens)} | "
                  f"{s.anneal_step:,} |")
    configs_differ = any("configs differ" in f for f in c.flags)
    return md + ["",
                 "Everything else in the two arms' saved configs is identical (checked: model, budget, LR schedule, "
                 "data, seed per pair" + ("; see the flags above" if configs_differ else "")
                 + "); the held-out chunks are the same for every arm and seed.", ""]


def tokens_section(c: Comparison) -> list[str]:
    """Whether the arms drew the same tokens per source, and each seed's table."""
    tolerance = "one step of tokens" if c.atol is None else fmt_tokens(c.atol) + " tokens"
    md = ["## Tokens per source (must be equal)", "",
          ("Equal: both arms drew the same tokens per source, up to the documents in flight at the end "
           f"(tolerance per source: {c.rtol:g} of its planned tokens, or where that is less, {tolerance})."
           if all(check.ok for check in c.checks)
           else "**MISMATCH — FLAGGED**: the arms did not draw the same tokens per source (see above)."), ""]
    for check in c.checks:
        md += seed_tokens_table(check)
    return md + [f"![tokens drawn]({c.plots['tokens']})", ""]


def seed_tokens_table(check: TokenCheck) -> list[str]:
    """One seed's steps, plan and mixer-target checks, and tokens per source of both arms."""
    targets = {None: "not checked (no final checkpoint)", True: "equal", False: "**NOT equal**"}[check.targets_equal]
    md = [f"Seed {check.seed}: {check.steps[0]:,} / {check.steps[1]:,} steps. Planned tokens (each run's saved "
          f"config): {'equal' if check.planned_equal else '**NOT equal**'}. Mixer targets (what each arm's mixer "
          f"aimed for over the tokens it trained, from the final checkpoint): {targets}.", "",
          "| source | planned | drawn: scheduled | drawn: fixed | difference | % of plan | tolerance "
          "| in flight at the end (sched / fixed) | |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in check.rows:
        flight = " / ".join("–" if x is None else fmt_tokens(x) for x in r.in_flight)
        md.append(f"| {r.source} | {fmt_tokens(r.planned)} | {fmt_tokens(r.scheduled)} | {fmt_tokens(r.fixed)} | "
                  f"{r.delta:+,d} | {100 * r.delta / max(r.planned, 1):+.2f}% | {fmt_tokens(r.tolerance)} | "
                  f"{flight} | {'ok' if r.ok else '**MISMATCH**'} |")
    return md + ["", "In flight: tokens of the documents the batch rows were in the middle of when the run stopped "
                 "(chosen and counted by the mixer, not trained).", ""]


def heldout_end_section(c: Comparison) -> list[str]:
    """Held-out loss per source at the end: both arms and the gain, mean and per seed."""
    md = ["## Held-out loss per source at the end", "",
          "| metric | scheduled | fixed | gain | gain per seed |",
          "|---|---:|---:|---:|---|"]
    for m, d in c.diffs.items():
        if m.startswith("heldout/"):
            md.append(f"| {m.split('/', 1)[1]} | {np.mean(d.scheduled):.4f} | {np.mean(d.fixed):.4f} | "
                      f"{pm(d.gain, d.std)} | {', '.join(f'{x:+.4f}' for x in d.gains)} |")
    return md + ["",
                 "Nats per token on the held-out chunks; gain = fixed - scheduled (positive: the schedule is better)"
                 + ("; mean ± std over seeds (the rule uses the standard error, std / sqrt(seeds))."
                    if len(c.seeds) > 1 else "."), "",
                 f"![held-out loss at the end]({c.plots['end']})", ""]


def along_run_section(c: Comparison) -> list[str]:
    """The along-the-run plot and the gain at each evaluation."""
    md = ["## Held-out loss along the run", "",
          f"![held-out loss along the run]({c.plots['along']})", "",
          f"The dotted line is the start of the anneal and the LR decay (step {c.schedule.anneal_step:,}).", ""]
    along = along_run_table(c.runs, c.seeds, c.schedule.anneal_step)
    return md + (along + [""] if along else [])


def downstream_section(c: Comparison) -> list[str]:
    """The evaluations of the suite other than the held-out loss, and the run directories."""
    md = ["## Downstream suite", "",
          "Evaluations: " + ", ".join(f"`{ev.name}` ({ev.description})" for ev in c.suite)
          + ". Add one with `ablations/evals.py`'s `@register` (see ablations/README.md).", ""]
    if any(ev.name != "heldout" for ev in c.suite):
        md += ["| metric | scheduled | fixed | gain | better |",
               "|---|---:|---:|---:|---|"]
        for m, d in c.diffs.items():
            if not m.startswith("heldout/"):
                md.append(f"| {m} | {np.mean(d.scheduled):.4f} | {np.mean(d.fixed):.4f} | {pm(d.gain, d.std)} | "
                          f"{'higher' if d.higher_is_better else 'lower'} |")
        md.append("")
    return md + ["Run directories: " + ", ".join(f"`{c.runs[a][s].name}`" for s in c.seeds for a in ARMS) + ".", ""]


def along_run_table(runs, seeds, decay_start: int) -> list[str]:
    """The :data:`GAIN` in held-out loss, overall and per source, at each evaluation of the first seed's runs;
    a cell is the mean over the seeds that evaluated both arms at that step."""
    rows = {arm: [read_metrics(runs[arm][s]) for s in seeds] for arm in ARMS}
    keys = ["val/loss"] + _source_losses(rows)
    steps = sorted(set.intersection(*(set(dict(series(rows[arm][0], "val/loss"))) for arm in ARMS)))
    gains = {k: _gains_at(rows, k, len(seeds)) for k in keys}
    head = ["step", "all"] + [k.split("/")[-1] for k in keys[1:]]
    intro = "Gain along the run (fixed - scheduled held-out loss; positive: the schedule is better"
    table = [intro + (", mean over seeds):" if len(seeds) > 1 else "):"), "", "| " + " | ".join(head) + " |",
             "|" + "---:|" * len(head)]
    return table + [_along_row(st, decay_start, [gains[k].get(st) for k in keys]) for st in steps] if steps else []


def _source_losses(rows) -> list[str]:
    """The ``val/loss/<source>`` keys of the first seed's scheduled run, sorted."""
    return sorted({k for r in rows["scheduled"][0] for k in r if k.startswith("val/loss/")})


def _along_row(step: int, decay_start: int, gains: list[list[float] | None]) -> str:
    first = f"{step:,}" + (" (anneal)" if step >= decay_start else "")
    return "| " + " | ".join([first] + [f"{np.mean(g):+.4f}" if g else "" for g in gains]) + " |"


def _gains_at(rows, key: str, n: int) -> dict[int, list[float]]:
    """step -> the gain (fixed - scheduled loss ``key``) of each seed that evaluated both arms there."""
    out: dict[int, list[float]] = {}
    for i in range(n):
        a, b = dict(series(rows["scheduled"][i], key)), dict(series(rows["fixed"][i], key))
        for st in a.keys() & b.keys():
            out.setdefault(st, []).append(b[st] - a[st])
    return out


# -- plots ---------------------------------------------------------------------------------------
ARM_COLORS = {"scheduled": "C0", "fixed": "C1"}


def write_plots(out: Path, runs, seeds, diffs, rule, decay_start: int, verdict: Verdict) -> dict[str, str]:
    """The report's three figures, written next to it; their file names by role."""
    along = _save(along_run_figure(runs, seeds, decay_start), out / "heldout_along_run.png")
    end = _save(end_figure(diffs, rule, verdict, len(seeds)), out / "heldout_end.png")
    tokens = _save(tokens_figure(runs, seeds, decay_start), out / "tokens_drawn.png")
    return {"along": along, "end": end, "tokens": tokens}


def along_run_figure(runs, seeds, decay_start: int):
    """heldout_along_run.png: per source and overall, the loss of both arms (top) and the gain (bottom)."""
    from matplotlib.figure import Figure

    rows = {arm: [read_metrics(runs[arm][s]) for s in seeds] for arm in ARMS}
    keys = _source_losses(rows) + ["val/loss"]
    fig = Figure(figsize=(3.2 * len(keys), 6.2))
    axes = fig.subplots(2, len(keys), sharex=True, squeeze=False)
    for j, key in enumerate(keys):
        ax, dx = axes[0, j], axes[1, j]
        _plot_losses(ax, rows, key, len(seeds))
        _plot_gain(dx, rows, key, len(seeds))
        for a in (ax, dx):
            a.axvline(decay_start, color="grey", ls=":", lw=1)
            a.grid(alpha=0.3)
        ax.set_title(key.split("/")[-1] if key != "val/loss" else "all")
        dx.set_xlabel("step")
    axes[0, 0].set_ylabel("held-out loss (nats/token)")
    axes[1, 0].set_ylabel("gain: fixed - scheduled\n(nats/token; > 0: schedule better)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("held-out loss along the run (dotted: anneal + LR decay start)"
                 + ("; bottom: each seed thin, mean thick, band ± std over seeds" if len(seeds) > 1 else ""))
    fig.tight_layout()
    return fig


def _plot_losses(ax, rows, key: str, n_seeds: int) -> None:
    """Each run's loss ``key``, zoomed on the last 70% of the run (the early losses, ~11.5 at step 0,
    would flatten the rest)."""
    for arm in ARMS:
        for i in range(n_seeds):
            pts = series(rows[arm][i], key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=ARM_COLORS[arm], marker=".",
                    lw=1.2 if n_seeds == 1 else 0.7, label=arm if i == 0 else None)
    pts = [p for arm in ARMS for r in rows[arm] for p in series(r, key)]
    last = max((st for st, _ in pts), default=0)
    late = [v for st, v in pts if st >= 0.3 * last and st > 0]
    if late:
        lo, hi = min(late), max(late)
        ax.set_ylim(lo - 0.08 * (hi - lo + 1e-3), hi + 0.08 * (hi - lo + 1e-3))


def _plot_gain(dx, rows, key: str, n_seeds: int) -> None:
    """The gain in loss ``key`` along the run: the mean, and with 2+ seeds each seed thin and mean ± std."""
    steps, mean, std, per_seed = _gain_series(rows, key, n_seeds)
    dx.axhline(0, color="k", lw=0.6)
    if not steps:
        return
    if n_seeds > 1:
        for ys in per_seed:
            dx.plot(steps, ys, color="C2", lw=0.6, alpha=0.6, marker=".", ms=2)
        dx.fill_between(steps, mean - std, mean + std, color="C2", alpha=0.2)
    dx.plot(steps, mean, color="C2", marker=".", lw=1.6)


def tokens_figure(runs, seeds, decay_start: int):
    """tokens_drawn.png: cumulative tokens per source of both arms, first seed (the schedule catches up in
    the anneal)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for arm, ls in (("scheduled", "-"), ("fixed", "--")):
        cum = _cumulative_tokens(runs[arm][seeds[0]])
        colors = source_colors(cum)
        for source, ys in cum.items():
            ax.plot(range(len(ys)), ys, ls=ls, color=colors[source], label=f"{source} ({arm})")
    ax.axvline(decay_start, color="grey", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="tokens drawn (cumulative)", title=f"tokens per source, seed {seeds[0]} "
           "(solid: scheduled, dashed: fixed)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


EVALUATION_UNITS = {"heldout": "held-out loss gain (nats/token)", "local": "cloze accuracy gain",
                    "lm_eval": "lm-eval score gain"}
"""The y-axis of each evaluation's panel in heldout_end.png (an evaluation not named here: its name)."""


def end_figure(diffs: dict[str, Difference], rule: DecisionRule, verdict: Verdict, n_seeds: int):
    """heldout_end.png: the gain of every metric at the end (bar: mean gain, error bar: t needed x SE, dots:
    each seed), one panel per evaluation (``heldout/...``, ``local/...``, ...): one quantity per axis.
    Dashed: -max_regression, below which a metric outside the noise worsens."""
    from matplotlib.figure import Figure

    groups: dict[str, list[str]] = {}
    for m in diffs:
        groups.setdefault(m.split("/", 1)[0], []).append(m)
    read = {a.metric: a for a in verdict.assessments}
    widths = [max(2.5, 0.9 * len(ms) + 1) for ms in groups.values()]
    fig = Figure(figsize=(max(6.5, sum(widths) + 0.5), 4.1))
    axes = fig.subplots(1, len(groups), squeeze=False, width_ratios=widths)[0]
    for ax, (ev, metrics) in zip(axes, groups.items()):
        for i, m in enumerate(metrics):
            d = diffs[m]
            a = read.get(m)
            color = {"improves": "C2", "worsens": "C3"}.get(a.status if a else "", "0.6")
            band = None if a is None or math.isnan(a.t_improve) else a.t_improve * a.se
            ax.bar(i, d.gain, color=color, alpha=0.7, yerr=band, capsize=5)
            ax.plot([i + 0.12 * (j - (d.n - 1) / 2) for j in range(d.n)], d.gains, "k.", ms=5)
        ax.axhline(0, color="k", lw=0.6)
        ax.axhline(-rule.max_regression, color="C3", ls="--", lw=0.8, label=f"-{rule.max_regression:g}: worse beyond")
        ax.set_xticks(range(len(metrics)), [m.split("/", 1)[1] for m in metrics],
                      rotation=30 if len(metrics) > 5 else 0, fontsize=8)
        ax.set_ylabel(EVALUATION_UNITS.get(ev, f"{ev} gain"))
        ax.set_title(ev, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"gain at the end, {n_seeds} seed(s): {verdict.outcome.upper()}\n(> 0: the schedule is better; "
                 "dots: pairs; bars: mean ± the t needed x SE)", fontsize=9)
    fig.tight_layout()
    return fig


def _gain_series(rows, key: str, n: int):
    """Steps evaluated by every run, and the gain at them: mean, std over seeds, each seed's."""
    at = {st: g for st, g in _gains_at(rows, key, n).items() if len(g) == n}
    steps = sorted(at)
    vals = np.array([at[st] for st in steps]).reshape(len(steps), n).T
    return steps, vals.mean(axis=0), vals.std(axis=0, ddof=1) if n > 1 else np.zeros(len(steps)), vals


def _cumulative_tokens(run_dir: Path) -> dict[str, np.ndarray]:
    per_step = tokens_per_step(run_dir)
    steps = sorted(per_step)
    sources = list(per_step[steps[0]]) if steps else []
    return {s: np.cumsum([per_step[st].get(s, 0) for st in steps]) for s in sources}


def _save(fig, path: Path) -> str:
    """Write a figure (a ``matplotlib.figure.Figure``: no pyplot, no backend, nothing to close) atomically."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path.name


# -- command line --------------------------------------------------------------------------------
@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rule = rule_from_args(args)
    suite = suite_from_args(args)
    if (args.out / "branch.json").is_file():
        md, ok = build_branch_report(args.out, rule, suite, rule_source(args))
    else:
        md, ok = build_report(args.out, rule, suite, args.token_rtol, args.token_atol, rule_source=rule_source(args))
    path = args.out / "report.md"
    write_text(path, md)
    print(md.split("## Setup")[0].split("## Held-out")[0].rstrip())
    print(f"\nreport: {path}")
    if not ok:
        print("CHECKS FAILED: see the flags at the top of the report", file=sys.stderr)
    return 0 if ok else 1


RULE_FLAGS = ("improve", "guard", "min_improvement", "max_regression", "alpha")
"""The flags that override a field of the decision rule (``--min-improvement`` sets ``min_improvement``)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the ablation folder: <arm>-seed<S>/ run directories")
    p.add_argument("--decision-rule", type=Path, default=DEFAULT_RULE,
                   help="YAML (default ablations/decision_rule.yaml)")
    p.add_argument("--improve", default=None, help="overrides the rule: metrics that must improve, comma-separated")
    p.add_argument("--min-improvement", type=float, default=None)
    p.add_argument("--guard", default=None, help="overrides the rule: metric patterns that must not worsen")
    p.add_argument("--max-regression", type=float, default=None, help="tolerance of the guard (metric units)")
    p.add_argument("--alpha", type=float, default=None,
                   help="overrides the rule: the false-decision rate of the report (t test, corrected across arms)")
    p.add_argument("--suite", default=None,
                   help="evaluations, comma-separated (ablations/evals.py; default: heldout,local where lm-eval is "
                        "installed, else heldout)")
    p.add_argument("--plugin", action="append", default=[], help="module to import first (registers evaluations)")
    p.add_argument("--token-rtol", type=float, default=0.005,
                   help="tolerance per source: share of its planned tokens (default 0.5%%)")
    p.add_argument("--token-atol", type=float, default=None,
                   help="the tolerance in tokens where the share gives less (default: one step, global batch x "
                        "final seq len)")
    return p


def rule_from_args(args: argparse.Namespace) -> DecisionRule:
    """The ``--decision-rule`` file with the fields the flags override (lists are comma-separated)."""
    overrides = {name: getattr(args, name) for name in RULE_FLAGS if getattr(args, name) is not None}
    for name in ("improve", "guard"):
        if name in overrides:
            overrides[name] = [m for m in overrides[name].split(",") if m]
    return dataclasses.replace(DecisionRule.load(args.decision_rule), **overrides)  # checked again


def suite_from_args(args: argparse.Namespace) -> list[Evaluation]:
    """The evaluations of ``--suite`` (after importing the ``--plugin`` modules), checked before any run is
    exported or evaluated."""
    for module in args.plugin:
        importlib.import_module(module)
    names = [n for n in (args.suite if args.suite is not None else default_suite(args.out)).split(",") if n]
    unknown = [n for n in names if n not in EVALUATIONS]
    if unknown:
        raise ConfigError(f"--suite: unknown evaluation(s) {unknown}; registered: {sorted(EVALUATIONS)}")
    harness = [n for n in names if n in ("lm_eval", "local")]
    if harness:
        from train.tools.evaluate import INSTALL_HINT, lm_eval_available

        if not lm_eval_available():
            raise ConfigError(f"--suite {','.join(harness)} needs lm-evaluation-harness, which is not "
                              f"installed: {INSTALL_HINT}")
    return [EVALUATIONS[n] for n in names]


def rule_source(args: argparse.Namespace) -> str:
    """Where the rule came from, as the report states it: its file and the flags that override it."""
    source = os.path.relpath(args.decision_rule, ROOT) if args.decision_rule.resolve().is_relative_to(ROOT) \
        else str(args.decision_rule)
    overridden = [f for f in RULE_FLAGS if getattr(args, f) is not None]
    return source + "".join(f", --{f.replace('_', '-')}" for f in overridden)


if __name__ == "__main__":
    sys.exit(main())
