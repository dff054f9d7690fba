"""The two pictures of ablations/diagnose.py's report (docs/diagnostics.md): ``diag_histogram.png``, the
per-batch distance from the target with the limit its mean is judged against, and ``diag_loss.png``,
each source's train loss with a dotted line where it starts a new epoch."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from data.files import atomic_path


def histogram_figure(data: dict):
    """The per-batch distance from the target along the run, its moving mean, and the limit the check
    judges the mean against (dashed, with where it comes from)."""
    from matplotlib.figure import Figure

    from data.plotting import plot_smoothed

    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    pts = [(s, v) for s, v in data["distances"] if not math.isnan(v)]
    plot_smoothed(ax, pts, "C0", "per batch (faint), moving mean")
    mean = float(np.mean([v for _, v in pts])) if pts else math.nan
    ax.axhline(mean, color="k", lw=1, label=f"mean over the run {mean:.3f}")
    limit, what = data.get("histogram_limit", (None, ""))
    if limit is not None:
        ax.axhline(limit, color="C3", ls="--", lw=1.2, label=f"limit on the mean {limit:.3f} ({what})")
    ax.set(xlabel="step", ylabel="share distance from target", title="per-batch source histogram: distance "
           "from the target" + ("" if limit is not None else " (no limit: no baseline without the order log)"))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def loss_figure(data: dict):
    """Per-source train loss, smoothed over the raw points, one colour per source (data/plotting.py:
    the same as loss_per_source.png); dotted: a source starts a new epoch."""
    from matplotlib.figure import Figure

    from data.plotting import plot_source_losses

    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    colors = plot_source_losses(ax, data["losses"])
    for s, marks in data["boundaries"].items():
        for _, step in marks:
            ax.axvline(step, color=colors.get(s, "k"), ls=":", lw=1)
    ax.set_title("per-source train loss (faint: each step; line: moving average; dotted: a new epoch)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_plots(out_dir: Path, data: dict) -> dict[str, str]:
    """diag_histogram.png, diag_loss.png; {} without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return {}

    def save(fig, name: str) -> str:
        with atomic_path(out_dir / name) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
        return name

    plots = {}
    if data["distances"]:
        plots["histogram"] = save(histogram_figure(data), "diag_histogram.png")
    if any(data["losses"].values()):
        plots["loss"] = save(loss_figure(data), "diag_loss.png")
    return plots
