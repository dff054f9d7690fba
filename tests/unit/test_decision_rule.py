"""The calibrated decision rule (ablations/decision.py): paired gains, a t test at n - 1 df corrected across arms
and metrics, the detectable gain; its error rates checked by simulation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from ablations.decision import (
    CANNOT_DECIDE,
    DROP,
    IMPROVES,
    KEEP,
    NO_GAIN,
    NOISE,
    UNDECIDED,
    WORSENS,
    DecisionRule,
    Difference,
    assess,
    decide,
    detectable_shift,
    rule_table,
)
from data.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RULE = DecisionRule(improve=["heldout/curated"], min_improvement=0.005, guard=["heldout/*"], max_regression=0.01)


def loss(metric: str, gains: list[float], base: float = 3.0) -> Difference:
    """A held-out loss whose fixed arm is ``base + i`` per seed and whose scheduled arm is lower by the gain."""
    fixed = [base + i for i in range(len(gains))]
    return Difference(metric, [f - g for f, g in zip(fixed, gains)], fixed, higher_is_better=False)


def test_paired_gain_mean_and_standard_error_by_hand():
    # losses per seed: scheduled 3.00 3.10 3.20, fixed 3.10 3.15 3.30 -> gains 0.10 0.05 0.10
    d = Difference("heldout/curated", [3.00, 3.10, 3.20], [3.10, 3.15, 3.30])
    assert d.gains == pytest.approx([0.10, 0.05, 0.10])
    assert d.gain == pytest.approx(0.25 / 3)
    # deviations 1/60, -1/30, 1/60: variance (1/3600 + 4/3600 + 1/3600) / 2 = 1/1200; SE = sqrt(1/1200 / 3) = 1/60
    assert d.std == pytest.approx(math.sqrt(1 / 1200))
    assert d.se == pytest.approx(1 / 60)
    a = assess(d, RULE, ("improve",))
    # t = 0.0833 / 0.0167 = 5.0 > Student's 95% quantile at 2 df (2.920), and 0.0833 > 0.005
    assert a.t == pytest.approx(5.0) and a.t_improve == pytest.approx(2.919986, abs=1e-5)
    assert a.status == IMPROVES and a.passes


def test_pairing_cancels_seed_effects():
    """Seeds differ by a whole nat each; unpaired, that spread would drown a steady 0.03 gain."""
    d = Difference("heldout/all", [2.97, 3.97, 4.97], [3.00, 4.00, 5.00])
    assert d.se == pytest.approx(0.0, abs=1e-12) and d.gain == pytest.approx(0.03)
    assert assess(d, RULE, ("improve",)).status == IMPROVES


def test_score_metrics_gain_when_higher():
    d = Difference("lm_eval/arc_easy/acc", [0.52, 0.55], [0.50, 0.51], higher_is_better=True)
    assert d.gains == pytest.approx([0.02, 0.04]) and d.gain == pytest.approx(0.03)
    assert d.se == pytest.approx(0.01)  # std of (0.02, 0.04) = 0.01 x sqrt(2); / sqrt(2)


@pytest.mark.parametrize(("gains", "alpha", "status"), [
    ([0.02, 0.04], 0.05, NOISE),             # t = 3, but Student's 95% quantile at 1 df is 6.31
    ([0.02, 0.04], 0.2, IMPROVES),           # ... and its 80% quantile 1.38
    ([0.05, 0.01, 0.06], 0.05, NOISE),       # t = 2.62: above the old fixed 2 SE, below 2.92 at 2 df
    ([0.10, -0.08, 0.04], 0.05, NOISE),      # mean 0.02, SE sqrt(0.0084 / 3) = 0.0529
    ([-0.03, -0.02, -0.04], 0.05, WORSENS),  # t = -5.2 < -2.92; 0.03 > the 0.01 tolerance
    ([-0.008, -0.006, -0.007], 0.05, NOISE),  # clearly below zero, but within the 0.01 tolerance
    ([0.004, 0.004, 0.004], 0.05, NOISE),    # no noise at all, but below the 0.005 minimum effect
])
def test_status_by_hand(gains, alpha, status):
    rule = DecisionRule(improve=["m"], min_improvement=0.005, guard=["*"], max_regression=0.01, alpha=alpha)
    a = assess(loss("m", gains), rule, ("improve", "guard"))
    assert a.status == status, (a.gain, a.se, a.t)


def test_more_arms_and_metrics_need_a_larger_t():
    """Bonferroni across arms for "improves"; across arms x metrics for "worsens"."""
    d = loss("m", [0.10, 0.05, 0.10])  # t = 5.0 at 2 df
    assert assess(d, RULE, ("improve",), arms=1).status == IMPROVES
    three = assess(d, RULE, ("improve",), arms=3)
    assert three.t_improve == pytest.approx(5.3394, abs=1e-3) and three.status == NOISE  # 1 - 0.05/3 quantile
    worse = loss("m", [-0.10, -0.05, -0.10])
    assert assess(worse, RULE, ("guard",), arms=1, metrics=1).status == WORSENS
    assert assess(worse, RULE, ("guard",), arms=1, metrics=4).status == NOISE  # 1 - 0.05/4 quantile: 6.2


def test_detectable_gain_is_the_gain_found_with_the_stated_power():
    """Simulated: with the true gain set to the detectable shift (in standard errors), the t test calls it
    "improves" in `power` of the draws."""
    rng = np.random.default_rng(0)
    for n in (3, 5):
        t_needed = float(stats.t.ppf(0.95, n - 1))
        shift = detectable_shift(t_needed, n - 1, 0.8)
        gains = rng.normal(shift / math.sqrt(n), 1.0, size=(40_000, n))
        t = gains.mean(1) / (gains.std(1, ddof=1) / math.sqrt(n))
        assert (t > t_needed).mean() == pytest.approx(0.8, abs=0.01)
    a = assess(loss("m", [0.10, 0.05, 0.10]), RULE, ("improve",))
    assert a.detectable == pytest.approx(detectable_shift(a.t_improve, 2, 0.8) * a.se)
    assert a.detectable > a.t_improve * a.se  # at 80% power the true gain must clear the bar by a margin


@pytest.mark.parametrize(("n", "arms"), [(2, 1), (3, 1), (3, 3), (6, 2)])
def test_false_keep_rate_is_at_most_alpha(n, arms):
    """A/A by simulation: arms no better than the control (two improve metrics, gains ~ N(0, 1) each, the
    arms sharing the control's draws) are called KEEP in at most alpha = 5% of reports, over all arms; the old
    rule (2 SE) was at 9-15% per metric at 2-3 pairs."""
    rng = np.random.default_rng(n * 10 + arms)
    rule = DecisionRule(improve=["a", "b"], guard=[], min_improvement=0.0)
    reports, false_keep = 400, 0
    for _ in range(reports):
        control = rng.normal(size=(2, n))
        arm_runs = control + rng.normal(size=(arms, 2, n))  # scheduled = fixed + noise with mean 0
        keeps = [decide(rule, {m: Difference(m, list(run[i]), list(control[i])) for i, m in enumerate("ab")},
                        arms=arms).keep for run in arm_runs]
        false_keep += any(keeps)
    # binomial: 400 reports at a true 5% give <= 33 with 97.5% probability
    assert false_keep <= 33, false_keep


def test_noise_case_numbers():
    d = loss("m", [0.10, -0.08, 0.04])
    assert d.gain == pytest.approx(0.02)
    assert d.se == pytest.approx(math.sqrt(0.0084 / 3))


@pytest.mark.parametrize("gains", [[0.5], []])
def test_fewer_than_two_seeds_cannot_decide(gains):
    if not gains:
        with pytest.raises(ValueError):  # nothing to pair
            Difference("m", [1.0], [])
        return
    diffs = {"heldout/curated": loss("heldout/curated", gains), "heldout/web": loss("heldout/web", [-0.9])}
    verdict = decide(RULE, diffs)
    assert verdict.outcome == CANNOT_DECIDE and not verdict.keep
    assert all(a.status == UNDECIDED and a.passes is None for a in verdict.assessments)
    assert "CANNOT DECIDE" in verdict.headline
    assert all(line.startswith("CANNOT DECIDE") for line in verdict.lines)
    assert math.isnan(diffs["heldout/curated"].se)


def test_verdicts():
    improve = loss("heldout/curated", [0.10, 0.05, 0.10])
    flat = loss("heldout/web", [0.001, -0.002, 0.0])
    worse = loss("heldout/code", [-0.03, -0.02, -0.04])
    noisy = loss("heldout/curated", [0.10, -0.08, 0.04])
    assert decide(RULE, {"heldout/curated": improve, "heldout/web": flat}).outcome == KEEP
    assert decide(RULE, {"heldout/curated": improve, "heldout/code": worse}).outcome == DROP
    assert decide(RULE, {"heldout/curated": noisy, "heldout/web": flat}).outcome == NO_GAIN
    # a metric outside the guard may worsen
    assert decide(DecisionRule(improve=["heldout/curated"], guard=["heldout/web"]),
                  {"heldout/curated": improve, "heldout/code": worse}).outcome == KEEP
    with pytest.raises(ConfigError, match="names"):
        decide(RULE, {"heldout/web": flat})


def test_table_states_the_rule_inputs():
    verdict = decide(RULE, {"heldout/curated": loss("heldout/curated", [0.10, 0.05, 0.10]),
                            "heldout/code": loss("heldout/code", [-0.03, -0.02, -0.04])})
    table = rule_table(verdict)
    assert table[0].startswith("| metric | role | pairs | gain per pair | mean gain | SE | t | t needed | p | "
                               "detectable gain | threshold")
    curated = next(r for r in table if "`heldout/curated`" in r)
    assert "| improve + guard | 3 | +0.1000, +0.0500, +0.1000 | +0.0833 | 0.0167 | +5.00 | 2.92 | 0.019 |" in curated
    assert "gain > 0.005" in curated and "improves" in curated and "PASS" in curated
    code = next(r for r in table if "`heldout/code`" in r)
    assert "| guard | 3 |" in code and "worsens" in code and "**FAIL**" in code
    one = rule_table(decide(RULE, {"heldout/curated": loss("heldout/curated", [0.1])}))
    assert "| 1 | +0.1000 | +0.1000 | – | – | – | – | – |" in one[2] and "cannot decide" in one[2]


def test_rule_file_and_validation(tmp_path):
    rule = DecisionRule.load(ROOT / "ablations" / "decision_rule.yaml")
    assert rule.improve == ["heldout/curated", "heldout/all"] and rule.alpha == 0.05 and rule.min_seeds == 2
    assert "t test" in rule.describe() and "detectable gain" in rule.describe() and "cannot decide" in rule.describe()
    for text, message in [("improve: [a]\nthreshold: 1\n", "unknown keys"), ("k_se: 2\n", "k_se is gone.*alpha"),
                          ("- a\n", "must be a mapping"), ("improve: [a\n", "cannot read"),
                          ("alpha: 0.7\n", "alpha must be in")]:
        (tmp_path / "r.yaml").write_text(text)
        with pytest.raises(ConfigError, match=message):
            DecisionRule.load(tmp_path / "r.yaml")
    with pytest.raises(ConfigError):
        DecisionRule(min_seeds=1)


# -- properties --------------------------------------------------------------------------------------
values = st.floats(-5, 5, allow_nan=False, allow_infinity=False)
seed_lists = st.lists(st.tuples(values, values), min_size=0, max_size=8)


def _diff(pairs, offsets=None) -> Difference:
    offsets = offsets or [0.0] * len(pairs)
    return Difference("m", [s + o for (s, _), o in zip(pairs, offsets)], [f + o for (_, f), o in zip(pairs, offsets)])


@settings(max_examples=200, deadline=None)
@given(pairs=seed_lists.filter(lambda p: len(p) >= 1), alpha=st.floats(0.001, 0.4), tol=st.floats(0, 0.5))
def test_swapping_the_arms_swaps_improves_and_worsens(pairs, alpha, tol):
    rule = DecisionRule(improve=["m"], min_improvement=tol, guard=["*"], max_regression=tol, alpha=alpha)
    a = assess(_diff(pairs), rule, ("improve",)).status
    b = assess(Difference("m", [f for _, f in pairs], [s for s, _ in pairs]), rule, ("improve",)).status
    assert {a, b} in ({IMPROVES, WORSENS}, {NOISE}, {UNDECIDED})


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(values, values), min_size=2, max_size=8), data=st.data())
def test_a_seed_effect_shared_by_both_arms_changes_nothing(pairs, data):
    offsets = data.draw(st.lists(st.integers(-3, 3), min_size=len(pairs), max_size=len(pairs)))
    a, b = _diff(pairs), _diff(pairs, [float(o) for o in offsets])
    assert b.gain == pytest.approx(a.gain, abs=1e-9)
    assert b.se == pytest.approx(a.se, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(values, values), max_size=1))
def test_never_a_decision_below_two_seeds(pairs):
    diffs = {"m": _diff(pairs)} if pairs else {}
    if not diffs:
        return
    assert decide(DecisionRule(improve=["m"], guard=["*"]), diffs).outcome == CANNOT_DECIDE
