"""The decision rule's error rates, measured on real decay branches (ablations/decision.py).

    python ablations/branch.py --from runs/demo --train-stable --arms ablations/demo_branch_arms.yaml \
        --replicates 12 --out runs/branch-evidence -- --config configs/demo.yaml
    python scripts/bench_decision.py runs/branch-evidence --arm curated50 --n 3

Reads every finished replicate's final held-out loss per source (ablations/evals.py ``heldout``) of
``control`` and of the planted arm (more curated tokens: ``heldout/curated`` must fall), then:

(a) **A/A**: ``--draws`` comparisons of two disjoint sets of n control replicates, one standing in for an
    arm (paired by position, as report.py pairs replicates): the share called KEEP by the rule is its
    false-positive rate (the rule's promise: at most ``alpha``);
(b) **planted effect**: ``--draws`` sets of n replicates, the arm against the control paired by replicate:
    the share of verdicts where the planted metric "improves" (the power the ablation has at this scale),
    and the median detectable gain the verdicts state.

Each rate comes with its Clopper-Pearson 95% interval over the draws, and the same over the disjoint draws
alone (the first ones: no replicate used twice, so those comparisons are independent).
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from ablations.decision import IMPROVES, DecisionRule, Difference, Verdict, decide
from ablations.evals import EVALUATIONS
from ablations.outcomes import is_complete
from ablations.report import DEFAULT_RULE, discover
from data.errors import ConfigError, one_line_errors


def rate(hits: list[bool]) -> str:
    k, n = sum(hits), len(hits)
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact")
    return f"{k}/{n} = {k / n:.1%} (95% CI {ci.low:.1%}-{ci.high:.1%})"


def draws(n_reps: int, size: int, count: int, rng: np.random.Generator) -> tuple[list[list[int]], int]:
    """``count`` sets of ``size`` replicate positions: first the disjoint ones (independent comparisons), then
    random ones; and how many are disjoint."""
    disjoint = [list(range(i, i + size)) for i in range(0, n_reps - size + 1, size)]
    return disjoint + [rng.choice(n_reps, size, replace=False).tolist() for _ in range(count - len(disjoint))], \
        len(disjoint)


def verdict(treated: list[dict], base: list[dict], rule: DecisionRule) -> Verdict:
    """The rule's verdict on runs ``treated`` against ``base``, paired by position (as report.py pairs them)."""
    metrics = [m for m in base[0] if all(m in e for e in treated + base)]
    return decide(rule, {f"heldout/{m}": Difference(f"heldout/{m}", [t[m] for t in treated], [b[m] for b in base])
                         for m in metrics})


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="a branch ablation folder (ablations/branch.py) with many replicates")
    p.add_argument("--arm", default="curated50", help="the planted arm (default curated50)")
    p.add_argument("--metric", default="heldout/curated", help="the metric the planted arm must improve")
    p.add_argument("--n", type=int, default=3, help="replicates per ablation (default 3)")
    p.add_argument("--draws", type=int, default=200, help="comparisons drawn for each rate (default 200)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    runs = discover(args.out)
    reps = sorted(r for r, d in runs.get("control", {}).items()
                  if is_complete(d) and r in runs.get(args.arm, {}) and is_complete(runs[args.arm][r]))
    if len(reps) < 2 * args.n:
        raise ConfigError(f"{args.out}: {len(reps)} finished replicates of both control and {args.arm}; the A/A "
                          f"comparison needs 2 x --n = {2 * args.n} (run ablations/branch.py with more --replicates)")
    heldout = EVALUATIONS["heldout"].fn
    control, arm = ([heldout(runs[a][r]) for r in reps] for a in ("control", args.arm))
    rule = DecisionRule.load(DEFAULT_RULE)
    rng = np.random.default_rng(args.seed)
    sets, disjoint = draws(len(reps), 2 * args.n, args.draws, rng)
    aa = [verdict([control[i] for i in s[:args.n]], [control[i] for i in s[args.n:]], rule) for s in sets]
    keep = [v.keep for v in aa]
    improves = [next(a for a in v.assessments if a.metric == args.metric).status == IMPROVES for v in aa]
    print(f"{args.out}: {len(reps)} replicates of control and {args.arm}; ablations of n = {args.n}; rule "
          f"{DEFAULT_RULE.name} (alpha {rule.alpha:g})")
    print(f"(a) A/A false KEEP: {rate(keep)}; the {disjoint} disjoint: {rate(keep[:disjoint])}; {args.metric} "
          f"alone called improves: {rate(improves)}")
    sets, disjoint = draws(len(reps), args.n, args.draws, rng)
    found = [next(a for a in verdict([arm[i] for i in s], [control[i] for i in s], rule).assessments
                  if a.metric == args.metric) for s in sets]
    hits = [a.status == IMPROVES for a in found]
    print(f"(b) planted: {args.metric} improves in {rate(hits)}; the {disjoint} disjoint: {rate(hits[:disjoint])}; "
          f"median detectable gain {np.median([a.detectable for a in found]):.4f}, median gain "
          f"{np.median([a.gain for a in found]):+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
