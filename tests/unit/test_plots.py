"""The pictures read at a glance: one colour per source in every plot, a smoothed line over the raw
points, the limit a check judges against drawn, one sign convention (the gain) and one quantity per
axis in the ablation report. Tiny figures, inspected as matplotlib objects (nothing written)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scripts_in_process import load_script

from ablations import diagnose as dg
from ablations import diagnose_plots as dplots
from ablations.decision import DecisionRule, Difference, decide
from data.plotting import SOURCE_COLORS, smooth, source_colors

pytest.importorskip("matplotlib")

from matplotlib.colors import to_hex  # noqa: E402 (after the importorskip)

SOURCES = ["web", "code", "books", "curated"]


def report_run():
    return load_script("report_run")


def noisy_losses(n: int = 60) -> dict[str, list[tuple[int, float]]]:
    rng = np.random.default_rng(0)
    return {s: [(t, 8.0 - 0.02 * t + k + rng.normal(0, 0.5)) for t in range(n)] for k, s in enumerate(SOURCES)}


def legend_colors(ax) -> dict[str, str]:
    """Legend label -> the colour of its line."""
    return {text.get_text(): to_hex(handle.get_color())
            for handle, text in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}


def test_a_source_has_one_colour_whatever_the_other_sources():
    assert source_colors(["books", "web"]) == {"books": SOURCE_COLORS["books"], "web": SOURCE_COLORS["web"]}
    assert source_colors(SOURCES)["books"] == source_colors(["books"])["books"]
    mixed = source_colors(["web", "zeta", "alpha"])
    assert len(set(mixed.values())) == 3 and mixed == source_colors(["alpha", "zeta", "web"])


def test_smoothing_averages_and_leaves_out_missing_steps():
    v = [1.0, 3.0, math.nan, 5.0, 7.0]
    got = smooth(v, 3)
    assert got[1] == pytest.approx(2.0) and got[2] == pytest.approx(4.0) and got[0] == pytest.approx(2.0)
    assert np.isnan(smooth([math.nan, math.nan], 3)).all()
    assert smooth([1.0, 3.0, 5.0], 5).tolist() == [2.0, 3.0, 4.0]  # shorter than the window: a window of 3
    assert smooth([4.0], 5).tolist() == [4.0] and smooth([1.0, 3.0], 5).tolist() == [1.0, 3.0]


def test_loss_per_source_and_diag_loss_share_the_palette_and_draw_a_smoothed_line():
    losses = noisy_losses()
    rows = [{"step": str(t), **{f"train/loss/{s}": str(losses[s][t][1]) for s in SOURCES}} for t in range(60)]
    rows[0].update({f"val/loss/{s}": "11.5" for s in SOURCES})
    fig = report_run().figure(rows, SOURCES)
    train_ax = fig.axes[0]
    want = {s: SOURCE_COLORS[s] for s in SOURCES}
    assert legend_colors(train_ax) == want
    assert legend_colors(fig.axes[1]) == want  # the held-out panel too

    diag = dplots.loss_figure({"losses": losses, "boundaries": {"books": [(1, 30)]}})
    assert legend_colors(diag.axes[0]) == want
    # per source: the raw points (faint) and the moving average (opaque, smoother: less variance)
    for ax in (train_ax, diag.axes[0]):
        books = [ln for ln in ax.get_lines() if to_hex(ln.get_color()) == SOURCE_COLORS["books"]
                 and len(ln.get_xdata()) == 60]
        raw, line = sorted(books, key=lambda ln: ln.get_alpha() or 1.0)
        assert raw.get_alpha() < 0.5 and line.get_label() == "books"
        assert np.std(np.diff(line.get_ydata())) < 0.5 * np.std(np.diff(raw.get_ydata()))
    epoch_marks = [ln for ln in diag.axes[0].get_lines() if list(ln.get_xdata()) == [30, 30]]
    assert [to_hex(ln.get_color()) for ln in epoch_marks] == [SOURCE_COLORS["books"]]


def test_the_histogram_plot_draws_the_limit_it_judges_against():
    distances = [(t, 0.2 + 0.05 * math.sin(t)) for t in range(40)]
    limit, what = dg.histogram_limit(dg.Thresholds(), 0.15)
    assert limit == pytest.approx(0.30)
    fig = dplots.histogram_figure({"distances": distances, "histogram_limit": (limit, what)})
    ax = fig.axes[0]
    flat = {round(ln.get_ydata()[0], 6): ln.get_label() for ln in ax.get_lines() if len(set(ln.get_ydata())) == 1}
    assert round(limit, 6) in flat and "limit" in flat[round(limit, 6)] and what in flat[round(limit, 6)]
    assert dg.check_histogram(distances, None, dg.Thresholds(), 0.15).summary.count(f"{limit:.3f}") == 1
    no_limit = dplots.histogram_figure({"distances": distances, "histogram_limit": (None, "no baseline")})
    assert "no limit" in no_limit.axes[0].get_title()


def test_the_ablation_end_plot_shows_gains_with_one_quantity_per_axis():
    from ablations.report import GAIN, end_figure

    diffs = {
        "heldout/curated": Difference("heldout/curated", [6.0, 6.1, 6.2], [6.2, 6.3, 6.4]),  # schedule better
        "heldout/all": Difference("heldout/all", [6.5, 6.5, 6.6], [6.5, 6.6, 6.6]),
        "local/cloze_web": Difference("local/cloze_web", [0.30, 0.25, 0.28], [0.25, 0.25, 0.25], True),
    }
    rule = DecisionRule()
    fig = end_figure(diffs, rule, decide(rule, diffs), 3)
    held, local = fig.axes
    assert "nats/token" in held.get_ylabel() and "accuracy" in local.get_ylabel()
    assert [t.get_text() for t in held.get_xticklabels()] == ["curated", "all"]
    assert [t.get_text() for t in local.get_xticklabels()] == ["cloze_web"]
    bars = [p.get_height() for p in held.patches]
    assert bars[0] == pytest.approx(0.2) and bars[0] > 0  # fixed - scheduled loss: positive, the schedule is better
    cloze = diffs["local/cloze_web"].gain
    assert local.patches[0].get_height() == pytest.approx(cloze) and cloze > 0  # scheduled - fixed accuracy
    assert "positive means the schedule is better" in GAIN
