"""The decision rule of an ablation, aware of seed noise (ablations/decision_rule.yaml).

Per metric the arms are paired by seed (or replicate); the gain of pair s is signed so that positive
means the schedule (the arm) is better. Over n pairs, g = mean(gain_s) and SE = std(gain_s, ddof=1) /
sqrt(n); a metric **improves** when g > k x SE and g > min_improvement, **worsens** when -g > k x SE
and -g > max_regression, is **within noise** otherwise, and **cannot be decided** with fewer than
``min_seeds`` (>= 2) pairs. The verdict: CANNOT DECIDE when a metric the rule reads cannot be decided;
else DROP when a guarded metric worsens, KEEP when every ``improve`` metric improves, NO CLEAR GAIN
otherwise.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

KEYS = ("improve", "min_improvement", "guard", "max_regression", "k_se", "min_seeds")

IMPROVES, WORSENS, NOISE, UNDECIDED = "improves", "worsens", "within noise", "cannot decide"
KEEP, DROP, NO_GAIN, CANNOT_DECIDE = "keep", "drop", "no clear gain", "cannot decide"
HEADLINES = {
    KEEP: "KEEP the schedule",
    DROP: "DROP the schedule (train the fixed mixture)",
    NO_GAIN: "NO CLEAR GAIN from the schedule (within seed noise; the fixed mixture is the simpler choice)",
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
    k_se: float = 2.0
    min_seeds: int = 2

    def __post_init__(self) -> None:
        if self.min_seeds < 2:
            raise ValueError(f"min_seeds must be at least 2 (a standard error needs 2 seeds), got {self.min_seeds}")
        if self.k_se < 0 or self.min_improvement < 0 or self.max_regression < 0:
            raise ValueError("k_se, min_improvement and max_regression must be >= 0")

    @classmethod
    def load(cls, path: Path) -> DecisionRule:
        d = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(d) - set(KEYS)
        if unknown:
            raise SystemExit(f"error: {path}: unknown keys {sorted(unknown)} (known: {', '.join(KEYS)})")
        return cls(**d)

    def describe(self) -> str:
        return (f"per metric, the gain of each seed paired with the same seed of the other arm; a metric improves "
                f"when its mean gain exceeds {self.k_se:g} x its standard error and {self.min_improvement:g}, and "
                f"worsens when its mean loss of quality exceeds {self.k_se:g} x SE and {self.max_regression:g}; "
                f"keep the schedule if {' and '.join(f'`{m}`' for m in self.improve) or 'nothing'} improve and no "
                f"metric matching {', '.join(f'`{g}`' for g in self.guard) or 'nothing'} worsens; "
                f"with fewer than {self.min_seeds} seeds: cannot decide")

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
    k_se: float
    min_improvement: float
    max_regression: float
    status: str
    """IMPROVES, WORSENS, NOISE or UNDECIDED."""

    @property
    def n(self) -> int:
        return len(self.gains)

    @property
    def passes(self) -> bool | None:
        """Whether the metric meets its roles (None: cannot decide)."""
        if self.status == UNDECIDED:
            return None
        if "improve" in self.roles and self.status != IMPROVES:
            return False
        return self.status != WORSENS


def assess(d: Difference, rule: DecisionRule, roles: tuple[str, ...]) -> Assessment:
    """The status of one metric under the rule (see the module docstring)."""
    gain, se = d.gain, d.se
    if d.n < rule.min_seeds:
        status = UNDECIDED
    elif gain > rule.k_se * se and gain > rule.min_improvement:
        status = IMPROVES
    elif -gain > rule.k_se * se and -gain > rule.max_regression:
        status = WORSENS
    else:
        status = NOISE
    return Assessment(d.metric, roles, [float(g) for g in d.gains], gain, se, rule.k_se, rule.min_improvement,
                      rule.max_regression, status)


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


def decide(rule: DecisionRule, diffs: dict[str, Difference]) -> Verdict:
    """The verdict over every metric the rule reads (``improve`` ones first, then the guarded ones)."""
    missing = [m for m in rule.improve if m not in diffs]
    if missing:
        raise SystemExit(f"error: the decision rule names {missing}, which no evaluation reports "
                         f"(have: {', '.join(sorted(diffs))})")
    read = list(rule.improve) + [m for m in diffs if rule.guards(m) and m not in rule.improve]
    assessments = [assess(diffs[m], rule, roles_of(rule, m)) for m in read]
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
            f"± {a.se:.4f} SE over {a.n} seeds (k x SE = {a.k_se * a.se:.4f})")


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
    out = ["| metric | role | seeds | gain per seed | mean gain | SE | k x SE | threshold | status | |",
           "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for a in verdict.assessments:
        per_seed = ", ".join(f"{g:+.{digits}f}" for g in a.gains)
        se = "–" if math.isnan(a.se) else f"{a.se:.{digits}f}"
        kse = "–" if math.isnan(a.se) else f"{a.k_se * a.se:.{digits}f}"
        thresholds = []
        if "improve" in a.roles:
            thresholds.append(f"gain > {a.min_improvement:g}")
        thresholds.append(f"loss of quality > {a.max_regression:g}")
        mark = {None: "–", True: "PASS", False: "**FAIL**"}[a.passes]
        out.append(f"| `{a.metric}` | {' + '.join(a.roles)} | {a.n} | {per_seed} | {a.gain:+.{digits}f} | {se} | "
                   f"{kse} | {'; '.join(thresholds)} | {a.status} | {mark} |")
    return out
