"""The decision rule of an ablation, calibrated for the few replicates an ablation can afford
(ablations/decision_rule.yaml).

Per metric the arms are paired by seed (or replicate); the gain of pair s is signed so that positive
means the arm (the schedule) is better. Over n pairs, g = mean(gain_s), SE = std(gain_s, ddof=1) / sqrt(n)
and t = g / SE, compared with Student's t at n - 1 degrees of freedom (one-sided):

- **improves** when t > t(1 - alpha / A) and g > min_improvement, A = the arms compared with the control in
  one report (Bonferroni across arms). KEEP needs *every* ``improve`` metric to improve, so no correction
  across those metrics is due: an arm no better than the control is called KEEP with probability <= alpha / A.
- **worsens** when -t > t(1 - alpha / (A x M)) and -g > max_regression, M = the metrics the rule reads (any
  one worsening drops the arm, so this side is corrected across metrics too).
- **cannot decide** with fewer than ``min_seeds`` (>= 2) pairs.

Every assessment also states its **detectable gain**: the smallest true gain that this test calls "improves"
with probability ``power`` at the observed SE (non-central t), and never less than ``min_improvement``. A
verdict of NO CLEAR GAIN with a detectable gain of 0.05 nats says "no gain above about 0.05", not "no gain".
The verdict: CANNOT DECIDE when a metric the rule reads cannot be decided; else DROP when a metric worsens,
KEEP when every ``improve`` metric improves, NO CLEAR GAIN otherwise. ablations/README.md gives the error
rates measured with this rule (scripts/bench_decision.py).
"""

from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from scipy import optimize, stats

from data.errors import ConfigError

KEYS = ("improve", "min_improvement", "guard", "max_regression", "alpha", "power", "min_seeds")

IMPROVES, WORSENS, NOISE, UNDECIDED = "improves", "worsens", "within noise", "cannot decide"
KEEP, DROP, NO_GAIN, CANNOT_DECIDE = "keep", "drop", "no clear gain", "cannot decide"
HEADLINES = {
    KEEP: "KEEP the schedule",
    DROP: "DROP the schedule (train the fixed mixture)",
    NO_GAIN: "NO CLEAR GAIN from the schedule (no gain above the detectable gain; the fixed mixture is the simpler "
             "choice)",
    CANNOT_DECIDE: "CANNOT DECIDE (fewer than 2 seeds: no estimate of the noise)",
}


@dataclass
class DecisionRule:
    """Keep the schedule if every ``improve`` metric improves beyond the noise and no ``guard`` metric
    worsens beyond it (and beyond ``max_regression``)."""

    improve: list[str] = field(default_factory=lambda: ["heldout/curated", "heldout/all"])
    min_improvement: float = 0.0
    guard: list[str] = field(default_factory=lambda: ["heldout/*"])
    max_regression: float = 0.01
    alpha: float = 0.05
    """The false-decision rate of one report: the chance that an arm no better than the control is called KEEP
    (or one no worse called DROP), whatever the number of arms and metrics."""
    power: float = 0.8
    """The probability with which the stated detectable gain would be called "improves"."""
    min_seeds: int = 2

    def __post_init__(self) -> None:
        if self.min_seeds < 2:
            raise ConfigError(f"min_seeds must be at least 2 (a standard error needs 2 seeds), got {self.min_seeds}")
        if self.min_improvement < 0 or self.max_regression < 0:
            raise ConfigError("min_improvement and max_regression must be >= 0")
        if not (0 < self.alpha < 0.5 and 0 < self.power < 1):
            raise ConfigError(f"alpha must be in (0, 0.5) and power in (0, 1), got alpha {self.alpha}, "
                              f"power {self.power}")

    @classmethod
    def load(cls, path: Path) -> DecisionRule:
        try:
            d = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read the decision rule ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: the decision rule must be a mapping of {', '.join(KEYS)}")
        if "k_se" in d:
            raise ConfigError(f"{path}: k_se is gone: the rule is a t test at the replicates' degrees of freedom, "
                              "corrected across arms and metrics; remove k_se and set alpha (default 0.05)")
        unknown = set(d) - set(KEYS)
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (known: {', '.join(KEYS)})")
        return cls(**d)

    def describe(self) -> str:
        return (f"per metric, the gain of each pair of runs (same seed or replicate) and a one-sided paired t test "
                f"at n - 1 degrees of freedom; a metric improves when t exceeds Student's 1 - {self.alpha:g}/A "
                f"quantile (A: the arms compared) and the mean gain exceeds {self.min_improvement:g}, and worsens "
                f"when -t exceeds the 1 - {self.alpha:g}/(A x M) quantile (M: the metrics read) and the mean loss "
                f"of quality exceeds {self.max_regression:g}; keep the schedule if "
                f"{' and '.join(f'`{m}`' for m in self.improve) or 'nothing'} improve and no metric matching "
                f"{', '.join(f'`{g}`' for g in self.guard) or 'nothing'} worsens; the detectable gain is the true "
                f"gain called an improvement with probability {self.power:g} at the observed noise; with fewer "
                f"than {self.min_seeds} seeds: cannot decide")

    def guards(self, metric: str) -> bool:
        return any(fnmatch.fnmatch(metric, g) for g in self.guard)


@dataclass
class Difference:
    """One metric over the paired seeds; ``gains`` > 0 where the schedule is better."""

    metric: str
    scheduled: list[float]
    fixed: list[float]
    higher_is_better: bool = False

    def __post_init__(self) -> None:
        if len(self.scheduled) != len(self.fixed):
            raise ValueError(f"{self.metric}: {len(self.scheduled)} scheduled vs {len(self.fixed)} fixed seeds")

    @property
    def n(self) -> int:
        return len(self.scheduled)

    @property
    def diffs(self) -> np.ndarray:
        """scheduled - fixed, per seed (in the metric's own sign)."""
        return np.asarray(self.scheduled, dtype=float) - np.asarray(self.fixed, dtype=float)

    @property
    def gains(self) -> np.ndarray:
        return self.diffs if self.higher_is_better else -self.diffs

    @property
    def mean(self) -> float:
        """Mean of scheduled - fixed (not signed as a gain)."""
        return float(self.diffs.mean())

    @property
    def std(self) -> float:
        return float(self.diffs.std(ddof=1)) if self.n > 1 else math.nan

    @property
    def gain(self) -> float:
        return float(self.gains.mean())

    @property
    def se(self) -> float:
        """Standard error of the mean gain (NaN with fewer than 2 seeds)."""
        return self.std / math.sqrt(self.n) if self.n > 1 else math.nan


@dataclass
class Assessment:
    """What the rule concludes about one metric, with every number it used."""

    metric: str
    roles: tuple[str, ...]
    """"improve" and/or "guard"."""
    gains: list[float]
    gain: float
    se: float
    t: float
    """gain / SE (NaN below ``min_seeds``)."""
    t_improve: float
    """The t that "improves" must exceed (Student's quantile at n - 1 df, corrected across arms)."""
    t_worsen: float
    """The -t that "worsens" must exceed (corrected across arms and metrics)."""
    detectable: float
    """The true gain this test calls "improves" with probability ``power``, at the observed SE."""
    min_improvement: float
    max_regression: float
    status: str
    """IMPROVES, WORSENS, NOISE or UNDECIDED."""

    @property
    def n(self) -> int:
        return len(self.gains)

    @property
    def p(self) -> float:
        """One-sided p-value of "the arm is better" (uncorrected; compare with alpha / arms)."""
        return float(stats.t.sf(self.t, self.n - 1)) if self.n > 1 else math.nan

    @property
    def passes(self) -> bool | None:
        """Whether the metric meets its roles (None: cannot decide)."""
        if self.status == UNDECIDED:
            return None
        if "improve" in self.roles and self.status != IMPROVES:
            return False
        return self.status != WORSENS


def assess(d: Difference, rule: DecisionRule, roles: tuple[str, ...], arms: int = 1, metrics: int = 1) -> Assessment:
    """The status of one metric under the rule, ``arms`` arms and ``metrics`` metrics read in the report
    (see the module docstring)."""
    gain, se, nan = d.gain, d.se, math.nan
    if d.n < rule.min_seeds:
        return Assessment(d.metric, roles, [float(g) for g in d.gains], gain, se, nan, nan, nan, nan,
                          rule.min_improvement, rule.max_regression, UNDECIDED)
    df = d.n - 1
    t = gain / se if se > 0 else math.copysign(math.inf, gain) if gain else 0.0
    t_improve = float(stats.t.ppf(1 - rule.alpha / arms, df))
    t_worsen = float(stats.t.ppf(1 - rule.alpha / (arms * metrics), df))
    shift = detectable_shift(t_improve, df, rule.power)
    if t > t_improve and gain > rule.min_improvement:
        status = IMPROVES
    elif -t > t_worsen and -gain > rule.max_regression:
        status = WORSENS
    else:
        status = NOISE
    return Assessment(d.metric, roles, [float(g) for g in d.gains], gain, se, t, t_improve, t_worsen,
                      max(rule.min_improvement, shift * se), rule.min_improvement, rule.max_regression, status)


@functools.lru_cache(maxsize=256)
def detectable_shift(t_needed: float, df: int, power: float) -> float:
    """The non-centrality at which a t at ``df`` degrees of freedom exceeds ``t_needed`` with probability
    ``power``: the detectable gain in standard errors (cached: one root-find per report shape)."""
    return float(optimize.brentq(lambda nc: stats.nct.sf(t_needed, df, nc) - power, 0.0, 20 * (t_needed + 1)))


@dataclass
class Verdict:
    outcome: str
    """KEEP, DROP, NO_GAIN or CANNOT_DECIDE."""
    assessments: list[Assessment]
    lines: list[str]

    @property
    def keep(self) -> bool:
        return self.outcome == KEEP

    @property
    def headline(self) -> str:
        return HEADLINES[self.outcome]


def decide(rule: DecisionRule, diffs: dict[str, Difference], arms: int = 1) -> Verdict:
    """The verdict over every metric the rule reads (``improve`` ones first, then the guarded ones), for one
    of ``arms`` arms compared with the same control in one report."""
    missing = [m for m in rule.improve if m not in diffs]
    if missing:
        raise ConfigError(f"the decision rule names {missing}, which no evaluation reports "
                          f"(have: {', '.join(sorted(diffs))}); fix --improve or the rule's `improve`")
    read = list(rule.improve) + [m for m in diffs if rule.guards(m) and m not in rule.improve]
    assessments = [assess(diffs[m], rule, roles_of(rule, m), arms, len(read)) for m in read]
    return Verdict(outcome_of(assessments), assessments, [verdict_line(a) for a in assessments])


def roles_of(rule: DecisionRule, metric: str) -> tuple[str, ...]:
    """What the rule asks of ``metric``: "improve" and/or "guard"."""
    return tuple(r for r, on in (("improve", metric in rule.improve), ("guard", rule.guards(metric))) if on)


def verdict_line(a: Assessment) -> str:
    """One line per metric: whether it meets its role, and the numbers that say so."""
    if a.status == UNDECIDED:
        return f"CANNOT DECIDE: `{a.metric}` has {a.n} seed(s); gain {a.gain:+.4f} with no standard error"
    what = {IMPROVES: "improves", WORSENS: "WORSENS", NOISE: "is within noise"}[a.status]
    role = "must improve" if "improve" in a.roles else "must not worsen"
    return (f"{'PASS' if a.passes else 'FAIL'}: `{a.metric}` {what} ({role}): mean gain {a.gain:+.4f} "
            f"± {a.se:.4f} SE over {a.n} pairs, t = {a.t:+.2f} (improves above {a.t_improve:.2f}, worsens below "
            f"{-a.t_worsen:.2f}); detectable gain {a.detectable:.4f}")


def outcome_of(assessments: list[Assessment]) -> str:
    """CANNOT_DECIDE, DROP, KEEP or NO_GAIN, in that order of precedence (see the module docstring)."""
    if any(a.status == UNDECIDED for a in assessments):
        return CANNOT_DECIDE
    if any(a.status == WORSENS for a in assessments):
        return DROP
    if all(a.status == IMPROVES for a in assessments if "improve" in a.roles):
        return KEEP
    return NO_GAIN


def rule_table(verdict: Verdict, digits: int = 4) -> list[str]:
    """The rule and every input it read, one Markdown table: a row per metric."""
    out = ["| metric | role | pairs | gain per pair | mean gain | SE | t | t needed | p | detectable gain | "
           "threshold | status | |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    def num(x: float, spec: str) -> str:
        return "–" if math.isnan(x) else format(x, spec)

    for a in verdict.assessments:
        per_pair = ", ".join(f"{g:+.{digits}f}" for g in a.gains)
        thresholds = []
        if "improve" in a.roles:
            thresholds.append(f"gain > {a.min_improvement:g}")
        thresholds.append(f"loss of quality > {a.max_regression:g}")
        mark = {None: "–", True: "PASS", False: "**FAIL**"}[a.passes]
        out.append(f"| `{a.metric}` | {' + '.join(a.roles)} | {a.n} | {per_pair} | {a.gain:+.{digits}f} | "
                   f"{num(a.se, f'.{digits}f')} | {num(a.t, '+.2f')} | {num(a.t_improve, '.2f')} | "
                   f"{num(a.p, '.3f')} | {num(a.detectable, f'.{digits}f')} | {'; '.join(thresholds)} | "
                   f"{a.status} | {mark} |")
    return out
