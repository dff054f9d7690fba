"""Compare the arms of an ablation from their logs and write ``OUT/report.md`` with its plots.

    python ablations/report.py runs/ablation-demo
    python ablations/report.py runs/ablation-350m_2b --improve heldout/curated --max-regression 0.02
    python ablations/report.py runs/ablation-350m_2b --suite heldout,lm_eval

Reads, for every ``OUT/<arm>-seed<S>`` (arms ``scheduled`` and ``fixed``; ablations/outcomes.py): the
CSV log and saved config, the order logs, and the final checkpoint's data cursors if present. No
wandb account is needed. Writes:

- ``report.md``: the verdict of the decision rule (ablations/decision.py: paired gains per seed, their
  mean and standard error; KEEP, DROP, NO CLEAR GAIN, or CANNOT DECIDE with fewer than 2 seeds) and
  one table of its inputs; tokens per source planned and actually drawn by each arm, which must be
  equal (a mismatch is FLAGGED at the top); held-out loss per source at the end for both arms and the
  gain (mean +- std over seeds, and each seed's); the other evaluations of ``--suite``;
- ``heldout_end.png`` (each seed's gain at the end, the mean +- k x SE, the rule's tolerance; one panel
  per evaluation, so losses and accuracies never share an axis), ``heldout_along_run.png`` (loss per
  source for both arms and the gain along the run, each seed and the spread),
  ``tokens_drawn.png`` (cumulative tokens per source of both arms).

Tokens drawn are equal "up to the documents in flight": each batch row is in the middle of a
document when the run stops, and the mixer balances sources to within about a document. A source
passes when the arms differ by at most ``--token-rtol`` (0.5%) of its planned tokens or, where that is
less, ``--token-atol`` tokens (default: one step's tokens, global batch x final sequence length: the
documents in flight at the end can hold that much). The planned tokens (from
each run's saved config) must agree to 1e-6.

One sign convention throughout, :data:`GAIN` (ablations/decision.py's): positive means the schedule
is better, in every table and plot.

Exit status: 0, or 1 when a check fails (tokens not equal, a run unfinished, an arm missing), so a
pipeline stops on an invalid comparison. The decision itself never changes the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
RUN_DIR = re.compile(r"^(scheduled|fixed)-seed(\d+)$")
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
            runs[m.group(1)][int(m.group(2))] = d
    return runs


def default_suite(out: Path) -> str:
    """``heldout,local`` where lm-eval is installed and every run has its final checkpoint (or the local
    tasks' cached results), else ``heldout`` with a note saying why."""
    from train.evaluate import INSTALL_HINT, LOCAL, lm_eval_available

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


def evaluate(suite: list[Evaluation], runs: dict[str, dict[int, Path]], seeds: list[int]) -> dict[str, Difference]:
    diffs: dict[str, Difference] = {}
    for ev in suite:
        results = {arm: [ev.fn(runs[arm][seed]) for seed in seeds] for arm in ARMS}
        names = [k for k in results["scheduled"][0] if all(k in r for arm in ARMS for r in results[arm])]
        for name in names:
            diffs[f"{ev.name}/{name}"] = Difference(
                f"{ev.name}/{name}", [r[name] for r in results["scheduled"]], [r[name] for r in results["fixed"]],
                ev.higher_is_better)
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
    flags: list[str] = []
    seeds = sorted(set(runs["scheduled"]) & set(runs["fixed"]))
    for arm in ARMS:
        for seed in sorted(set(runs[arm]) - set(seeds)):
            flags.append(f"`{runs[arm][seed].name}` has no counterpart in the other arm: left out")
    if not seeds:
        raise ConfigError(f"{out} holds no pair of scheduled-seed<S>/ and fixed-seed<S>/ run directories "
                          "with csv/metrics.csv (run ablations/run.py first)")
    for seed in seeds:
        for arm in ARMS:
            if not is_complete(runs[arm][seed]):
                flags.append(f"`{runs[arm][seed].name}` is not finished: its last held-out loss predates the end "
                             "of the schedule (resume it: re-run ablations/run.py with the same arguments)")
    for seed in seeds:
        differ = config_differences(*(read_config(runs[arm][seed]) for arm in ARMS), allowed=ARM_KEYS)
        if differ:
            flags.append(f"seed {seed}: the arms' configs differ in more than the mixture: "
                         + ", ".join(f"`{k}`" for k in differ))
    checks = []
    for seed in seeds:
        check = check_tokens(seed, {arm: runs[arm][seed] for arm in ARMS}, rtol, atol)
        checks.append(check)
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
    diffs = evaluate(suite, runs, seeds)
    verdict = decide(rule, diffs)
    configs = {arm: read_config(runs[arm][seeds[0]]) for arm in ARMS}
    schedule = schedule_of(configs["scheduled"])

    plots = write_plots(out, runs, seeds, diffs, rule, schedule.decay_start, verdict)
    md = render(Comparison(out, seeds, runs, configs, schedule, flags, checks, diffs, rule, verdict, suite, plots,
                           rtol, atol, rule_source))
    return md, not flags


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
    out, seeds, runs, configs, schedule, flags = c.out, c.seeds, c.runs, c.configs, c.schedule, c.flags
    checks, diffs, rule, verdict, suite, plots = c.checks, c.diffs, c.rule, c.verdict, c.suite, c.plots
    rtol, atol, rule_source = c.rtol, c.atol, c.rule_source
    name = configs["scheduled"]["run"].get("wandb_group") or out.name
    md = [f"# Ablation report: {name}", ""]
    shown = os.path.relpath(out) if Path(out).resolve().is_relative_to(Path.cwd()) else str(out)
    md.append(f"Scheduled vs fixed mixture, {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), "
              f"from the logs in `{shown}` (`python ablations/report.py {shown}`).")
    md.append("")
    if flags:
        md.append("## ⚠️ CHECKS FAILED: this is not a valid comparison")
        md.append("")
        md += [f"- **FLAG**: {f}" for f in flags]
        md.append("")
    md.append("## Verdict")
    md.append("")
    md.append(f"**{verdict.headline}**" + (" — but see the failed checks above" if flags else "") + ".")
    md.append("")
    md.append(f"Rule (`{rule_source}`): {rule.describe()}.")
    md.append("")
    md.append(f"Every table and plot of this report shows the {GAIN}. SE = standard error of the mean gain "
              "over the paired seeds.")
    md.append("")
    md += rule_table(verdict)
    md.append("")
    md += [f"- {line}" for line in verdict.lines]
    if len(seeds) < rule.min_seeds:
        md.append(f"- {len(seeds)} seed(s): no estimate of the seed noise, so no decision; run "
                  "`ablations/run.py --num-seeds 3` (the default) to tell small differences from noise")
    md.append("")

    md.append("## Setup")
    md.append("")
    md.append("| arm | mixture | steps | tokens | anneal + LR decay from step |")
    md.append("|---|---|---|---|---|")
    for arm in ARMS:
        s = schedule_of(configs[arm])
        md.append(f"| {arm} | {mixture_text(configs[arm])} | {s.total_steps:,} | {fmt_tokens(s.total_tokens)} | "
                  f"{s.decay_start:,} |")
    md.append("")
    md.append("Everything else in the two arms' saved configs is identical (checked: model, budget, LR schedule, "
              "data, seed per pair" + ("; see the flags above" if any("configs differ" in f for f in flags) else "")
              + "); the held-out chunks are the same for every arm and seed.")
    md.append("")

    md.append("## Tokens per source (must be equal)")
    md.append("")
    all_ok = all(c.ok for c in checks)
    md.append(("Equal: both arms drew the same tokens per source, up to the documents in flight at the end "
               f"(tolerance per source: {rtol:g} of its planned tokens, or where that is less, "
               f"{'one step of tokens' if atol is None else fmt_tokens(atol) + ' tokens'})."
               if all_ok else "**MISMATCH — FLAGGED**: the arms did not draw the same tokens per source (see above)."))
    md.append("")
    for c in checks:
        targets = {None: "not checked (no final checkpoint)", True: "equal", False: "**NOT equal**"}[c.targets_equal]
        md.append(f"Seed {c.seed}: {c.steps[0]:,} / {c.steps[1]:,} steps. Planned tokens (each run's saved config): "
                  f"{'equal' if c.planned_equal else '**NOT equal**'}. Mixer targets (what each arm's mixer aimed "
                  f"for over the tokens it trained, from the final checkpoint): {targets}.")
        md.append("")
        md.append("| source | planned | drawn: scheduled | drawn: fixed | difference | % of plan | tolerance "
                  "| in flight at the end (sched / fixed) | |")
        md.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in c.rows:
            flight = " / ".join("–" if x is None else fmt_tokens(x) for x in r.in_flight)
            md.append(f"| {r.source} | {fmt_tokens(r.planned)} | {fmt_tokens(r.scheduled)} | {fmt_tokens(r.fixed)} | "
                      f"{r.delta:+,d} | {100 * r.delta / max(r.planned, 1):+.2f}% | {fmt_tokens(r.tolerance)} | "
                      f"{flight} | {'ok' if r.ok else '**MISMATCH**'} |")
        md.append("")
        md.append("In flight: tokens of the documents the batch rows were in the middle of when the run stopped "
                  "(chosen and counted by the mixer, not trained).")
        md.append("")
    md.append(f"![tokens drawn]({plots['tokens']})")
    md.append("")

    md.append("## Held-out loss per source at the end")
    md.append("")
    md.append("| metric | scheduled | fixed | gain | gain per seed |")
    md.append("|---|---:|---:|---:|---|")
    for m, d in diffs.items():
        if m.startswith("heldout/"):
            md.append(f"| {m.split('/', 1)[1]} | {np.mean(d.scheduled):.4f} | {np.mean(d.fixed):.4f} | "
                      f"{pm(d.gain, d.std)} | {', '.join(f'{x:+.4f}' for x in d.gains)} |")
    md.append("")
    md.append("Nats per token on the held-out chunks; gain = fixed - scheduled (positive: the schedule is better)"
              + ("; mean ± std over seeds (the rule uses the standard error, std / sqrt(seeds))."
                 if len(seeds) > 1 else "."))
    md.append("")
    md.append(f"![held-out loss at the end]({plots['end']})")
    md.append("")
    md.append("## Held-out loss along the run")
    md.append("")
    md.append(f"![held-out loss along the run]({plots['along']})")
    md.append("")
    md.append(f"The dotted line is the start of the anneal and the LR decay (step {schedule.decay_start:,}).")
    md.append("")
    along = along_run_table(runs, seeds, schedule.decay_start)
    if along:
        md += along
        md.append("")

    others = [ev for ev in suite if ev.name != "heldout"]
    md.append("## Downstream suite")
    md.append("")
    md.append("Evaluations: " + ", ".join(f"`{ev.name}` ({ev.description})" for ev in suite)
              + ". Add one with `ablations/evals.py`'s `@register` (see ablations/README.md).")
    md.append("")
    if others:
        md.append("| metric | scheduled | fixed | gain | better |")
        md.append("|---|---:|---:|---:|---|")
        for m, d in diffs.items():
            if not m.startswith("heldout/"):
                md.append(f"| {m} | {np.mean(d.scheduled):.4f} | {np.mean(d.fixed):.4f} | {pm(d.gain, d.std)} | "
                          f"{'higher' if d.higher_is_better else 'lower'} |")
        md.append("")
    md.append("Run directories: " + ", ".join(f"`{runs[a][s].name}`" for s in seeds for a in ARMS) + ".")
    md.append("")
    return "\n".join(md)


def along_run_table(runs, seeds, decay_start: int) -> list[str]:
    """The gain (fixed - scheduled held-out loss: positive, the schedule is better), overall and per
    source, at each evaluation."""
    rows = {arm: [read_metrics(runs[arm][s]) for s in seeds] for arm in ARMS}
    keys = ["val/loss"] + sorted({k for r in rows["scheduled"][0] for k in r if k.startswith("val/loss/")})
    steps = sorted(set.intersection(*({st for st, _ in series(rows[arm][0], "val/loss")} for arm in ARMS)))
    if not steps:
        return []
    head = ["step"] + ["all" if k == "val/loss" else k.split("/")[-1] for k in keys]
    out = ["Gain along the run (fixed - scheduled held-out loss; positive: the schedule is better"
           + (", mean over seeds" if len(seeds) > 1 else "") + "):", "",
           "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for st in steps:
        cells = [f"{st:,}" + (" (anneal)" if st >= decay_start else "")]
        for k in keys:
            d = []
            for i in range(len(seeds)):
                a, b = dict(series(rows["scheduled"][i], k)), dict(series(rows["fixed"][i], k))
                if st in a and st in b:
                    d.append(b[st] - a[st])
            cells.append(f"{np.mean(d):+.4f}" if d else "")
        out.append("| " + " | ".join(cells) + " |")
    return out


# -- plots ---------------------------------------------------------------------------------------
def write_plots(out: Path, runs, seeds, diffs, rule, decay_start: int, verdict: Verdict) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"scheduled": "C0", "fixed": "C1"}
    rows = {arm: [read_metrics(runs[arm][s]) for s in seeds] for arm in ARMS}
    keys = sorted({k for r in rows["scheduled"][0] for k in r if k.startswith("val/loss/")}) + ["val/loss"]
    names = [k.split("/")[-1] if k != "val/loss" else "all" for k in keys]

    # 1. along the run: loss per source for both arms (top), their difference (bottom)
    fig, axes = plt.subplots(2, len(keys), figsize=(3.2 * len(keys), 6.2), sharex=True, squeeze=False)
    for j, (key, name) in enumerate(zip(keys, names)):
        ax, dx = axes[0, j], axes[1, j]
        for arm in ARMS:
            for i in range(len(seeds)):
                pts = series(rows[arm][i], key)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[arm], marker=".",
                        lw=1.2 if len(seeds) == 1 else 0.7, label=arm if i == 0 else None)
        pts = [p for arm in ARMS for r in rows[arm] for p in series(r, key)]
        last = max((st for st, _ in pts), default=0)
        late = [v for st, v in pts if st >= 0.3 * last and st > 0]
        if late:  # zoom on the last 70% of the run: the early losses (~11.5 at step 0) flatten the rest
            lo, hi = min(late), max(late)
            ax.set_ylim(lo - 0.08 * (hi - lo + 1e-3), hi + 0.08 * (hi - lo + 1e-3))
        steps, mean, std, per_seed = _gain_series(rows, key, len(seeds))
        dx.axhline(0, color="k", lw=0.6)
        if steps:
            if len(seeds) > 1:  # each seed's difference, thin, and the spread (mean ± std) around the mean
                for ys in per_seed:
                    dx.plot(steps, ys, color="C2", lw=0.6, alpha=0.6, marker=".", ms=2)
                dx.fill_between(steps, mean - std, mean + std, color="C2", alpha=0.2)
            dx.plot(steps, mean, color="C2", marker=".", lw=1.6)
        for a in (ax, dx):
            a.axvline(decay_start, color="grey", ls=":", lw=1)
            a.grid(alpha=0.3)
        ax.set_title(name)
        dx.set_xlabel("step")
    axes[0, 0].set_ylabel("held-out loss (nats/token)")
    axes[1, 0].set_ylabel("gain: fixed - scheduled\n(nats/token; > 0: schedule better)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("held-out loss along the run (dotted: anneal + LR decay start)"
                 + ("; bottom: each seed thin, mean thick, band ± std over seeds" if len(seeds) > 1 else ""))
    fig.tight_layout()
    along = _save(fig, out / "heldout_along_run.png")

    # 2. at the end: the gain per metric, one panel per evaluation (losses and accuracies never share an axis)
    end = _save(end_figure(diffs, rule, verdict, len(seeds)), out / "heldout_end.png")

    # 3. cumulative tokens per source (first seed): the schedule catches up in the anneal
    fig, ax = plt.subplots(figsize=(7, 4))
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
    tokens = _save(fig, out / "tokens_drawn.png")
    return {"along": along, "end": end, "tokens": tokens}


EVALUATION_UNITS = {"heldout": "held-out loss gain (nats/token)", "local": "cloze accuracy gain",
                    "lm_eval": "lm-eval score gain"}
"""The y-axis of each evaluation's panel in heldout_end.png (an evaluation not named here: its name)."""


def end_figure(diffs: dict[str, Difference], rule: DecisionRule, verdict: Verdict, n_seeds: int):
    """heldout_end.png: the gain of every metric at the end (bar: mean gain, error bar: k x SE, dots:
    each seed), one panel per evaluation (``heldout/...``, ``local/...``, ...): one quantity per axis.
    Dashed: -max_regression, below which a metric outside the noise worsens."""
    from matplotlib.figure import Figure

    groups: dict[str, list[str]] = {}
    for m in diffs:
        groups.setdefault(m.split("/", 1)[0], []).append(m)
    status = {a.metric: a.status for a in verdict.assessments}
    widths = [max(2.5, 0.9 * len(ms) + 1) for ms in groups.values()]
    fig = Figure(figsize=(max(6.5, sum(widths) + 0.5), 4.1))
    axes = fig.subplots(1, len(groups), squeeze=False, width_ratios=widths)[0]
    for ax, (ev, metrics) in zip(axes, groups.items()):
        for i, m in enumerate(metrics):
            d = diffs[m]
            color = {"improves": "C2", "worsens": "C3"}.get(status.get(m, ""), "0.6")
            band = None if math.isnan(d.se) else rule.k_se * d.se
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
                 f"dots: seeds; bars: mean ± {rule.k_se:g} SE)", fontsize=9)
    fig.tight_layout()
    return fig


def _gain_series(rows, key: str, n: int):
    """Steps evaluated by every run, and the gain (fixed - scheduled loss) at them: mean, std over
    seeds, each seed's."""
    per_seed = []
    for i in range(n):
        a, b = dict(series(rows["scheduled"][i], key)), dict(series(rows["fixed"][i], key))
        per_seed.append({st: b[st] - a[st] for st in a if st in b})
    steps = sorted(set.intersection(*(set(d) for d in per_seed))) if per_seed else []
    if not steps:
        return [], np.array([]), np.array([]), np.zeros((0, 0))
    vals = np.array([[d[st] for st in steps] for d in per_seed])
    return steps, vals.mean(axis=0), vals.std(axis=0, ddof=1) if n > 1 else np.zeros(len(steps)), vals


def _cumulative_tokens(run_dir: Path) -> dict[str, np.ndarray]:
    per_step = tokens_per_step(run_dir)
    steps = sorted(per_step)
    sources = list(per_step[steps[0]]) if steps else []
    return {s: np.cumsum([per_step[st].get(s, 0) for st in steps]) for s in sources}


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    if plt.fignum_exists(getattr(fig, "number", -1)):  # a pyplot figure; a matplotlib.figure.Figure is not registered
        plt.close(fig)
    return path.name


# -- command line --------------------------------------------------------------------------------
@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the ablation folder: <arm>-seed<S>/ run directories")
    p.add_argument("--decision-rule", type=Path, default=DEFAULT_RULE,
                   help="YAML (default ablations/decision_rule.yaml)")
    p.add_argument("--improve", default=None, help="overrides the rule: metrics that must improve, comma-separated")
    p.add_argument("--min-improvement", type=float, default=None)
    p.add_argument("--guard", default=None, help="overrides the rule: metric patterns that must not worsen")
    p.add_argument("--max-regression", type=float, default=None, help="tolerance of the guard (metric units)")
    p.add_argument("--k-se", type=float, default=None, help="overrides the rule: the multiple of the standard error")
    p.add_argument("--suite", default=None,
                   help="evaluations, comma-separated (ablations/evals.py; default: heldout,local where lm-eval is "
                        "installed, else heldout)")
    p.add_argument("--plugin", action="append", default=[], help="module to import first (registers evaluations)")
    p.add_argument("--token-rtol", type=float, default=0.005,
                   help="tolerance per source: share of its planned tokens (default 0.5%%)")
    p.add_argument("--token-atol", type=float, default=None,
                   help="the tolerance in tokens where the share gives less (default: one step, global batch x "
                        "final seq len)")
    args = p.parse_args(argv)

    rule = DecisionRule.load(args.decision_rule)
    if args.improve is not None:
        rule.improve = [m for m in args.improve.split(",") if m]
    if args.guard is not None:
        rule.guard = [m for m in args.guard.split(",") if m]
    if args.min_improvement is not None:
        rule.min_improvement = args.min_improvement
    if args.max_regression is not None:
        rule.max_regression = args.max_regression
    if args.k_se is not None:
        rule.k_se = args.k_se
    for module in args.plugin:
        importlib.import_module(module)
    if args.suite is None:
        args.suite = default_suite(args.out)
    names = [n for n in args.suite.split(",") if n]
    unknown = [n for n in names if n not in EVALUATIONS]
    if unknown:
        raise ConfigError(f"--suite: unknown evaluation(s) {unknown}; registered: {sorted(EVALUATIONS)}")
    harness = [n for n in names if n in ("lm_eval", "local")]
    if harness:  # checked before any run is exported or evaluated
        from train.evaluate import INSTALL_HINT, lm_eval_available

        if not lm_eval_available():
            raise ConfigError(f"--suite {','.join(harness)} needs lm-evaluation-harness, which is not "
                              f"installed: {INSTALL_HINT}")
    overridden = [f for f in ("improve", "guard", "min_improvement", "max_regression", "k_se")
                  if getattr(args, f) is not None]
    source = os.path.relpath(args.decision_rule, ROOT) if args.decision_rule.resolve().is_relative_to(ROOT) \
        else str(args.decision_rule)
    source += "".join(f", --{f.replace('_', '-')}" for f in overridden)
    md, ok = build_report(args.out, rule, [EVALUATIONS[n] for n in names], args.token_rtol, args.token_atol,
                          rule_source=source)
    path = args.out / "report.md"
    write_text(path, md)
    print(md.split("## Setup")[0].rstrip())
    print(f"\nreport: {path}")
    if not ok:
        print("CHECKS FAILED: see the flags at the top of the report", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
