"""One look for every picture the project draws: one colour per data source, smoothed loss lines.

Every plot that shows sources (``loss_per_source.png`` of scripts/report_run.py, ``diag_loss.png`` of
ablations/diagnose.py, ``tokens_drawn.png`` of ablations/report.py, the plan's mixture of data/plan.py)
takes its colours from :func:`source_colors`, so ``books`` is the same green everywhere, and draws a
noisy per-step series with :func:`plot_smoothed`: the raw points faint, a centred moving average over
them in the same colour (the line the eye reads: "falls smoothly, not in steps").

matplotlib is imported by the callers, never here: the data path imports data/plan.py.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Sequence

import numpy as np

SOURCE_COLORS = {
    "web": "#1f77b4",      # blue
    "code": "#ff7f0e",     # orange
    "books": "#2ca02c",    # green
    "curated": "#d62728",  # red
    "pdfs": "#9467bd",     # purple
}
"""The sources of the shipped configs (demo: web, code, books, curated; the real run: web, code, pdfs,
curated), each with its colour in every picture."""
OTHER_COLORS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39")
"""For sources not in :data:`SOURCE_COLORS`, handed out in name order."""
RAW_ALPHA = 0.25
"""Opacity of the raw points under a smoothed line."""


def source_colors(sources: Iterable[str]) -> dict[str, str]:
    """Source -> colour: the fixed colour of a known source; the others get :data:`OTHER_COLORS` in
    sorted-name order (the same set of sources gets the same colours in every picture; past eight
    unknown sources, a colour chosen by the name's CRC-32)."""
    out, unknown = {}, []
    for s in sources:
        if s in SOURCE_COLORS:
            out[s] = SOURCE_COLORS[s]
        else:
            unknown.append(s)
    for i, s in enumerate(sorted(set(unknown))):
        out[s] = OTHER_COLORS[i] if i < len(OTHER_COLORS) else OTHER_COLORS[zlib.crc32(s.encode()) % len(OTHER_COLORS)]
    return out


def smoothing_window(n: int) -> int:
    """Points in the moving average of an ``n``-point series: about 1/20 of it, at least 5 (odd)."""
    w = max(5, n // 20)
    return w + 1 - w % 2


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Centred moving average over ``window`` points; NaNs (a step without the source) are left out of
    each mean, and a point whose whole window is NaN stays NaN. Near the ends the window shrinks."""
    v = np.asarray(values, dtype=float)
    if window > len(v):  # np.convolve's "same" would return max(len, window) points; keep it odd (centred)
        window = len(v) - (1 - len(v) % 2)
    if window <= 1:
        return v.copy()
    ok = ~np.isnan(v)
    kernel = np.ones(window)
    sums = np.convolve(np.where(ok, v, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def plot_smoothed(ax, points: Sequence[tuple[float, float]], color: str, label: str, window: int | None = None):
    """The raw ``(step, value)`` points faint and their moving average on top, both in ``color``; the
    legend names the smoothed line only. Returns the smoothed line (a matplotlib Line2D)."""
    if not points:
        return None
    st, v = np.asarray(points, dtype=float).T
    ax.plot(st, v, color=color, lw=0.5, alpha=RAW_ALPHA)
    w = window or smoothing_window(len(v))
    [line] = ax.plot(st, smooth(v, w), color=color, lw=1.6, label=label)
    return line


def loss_ylim(series: Iterable[Sequence[tuple[float, float]]], skip_frac: float = 0.1) -> tuple[float, float] | None:
    """A y-range for loss curves that leaves out each series' first ``skip_frac`` (the fall from ~11.5
    nats at step 0 would flatten the rest): the 1st to 99th percentile, with a 10% margin."""
    vals = [v for pts in series for _, v in list(pts)[int(len(pts) * skip_frac):] if not math.isnan(v)]
    if not vals:
        return None
    lo, hi = np.percentile(vals, [1, 99])
    pad = 0.1 * (hi - lo) or 0.1
    return float(lo - pad), float(hi + pad)


def plot_source_losses(ax, losses: dict[str, Sequence[tuple[float, float]]], ylabel: str = "train loss (nats/token)"):
    """Every source's loss series on ``ax``: smoothed over its raw points, one colour per source."""
    colors = source_colors(losses)
    for s, pts in losses.items():
        plot_smoothed(ax, pts, colors[s], s)
    lim = loss_ylim(losses.values())
    if lim:
        ax.set_ylim(*lim)
    ax.set(xlabel="step", ylabel=ylabel)
    return colors
