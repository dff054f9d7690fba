"""Does the shuffle mix? Five diagnostics of one training run, from its logs (docs/diagnostics.md).

    python scripts/diagnose_run.py runs/demo            # writes runs/demo/diagnostics.md and its plots

Reads ``<run>/csv/metrics.csv`` (``train/share_distance``, ``train/loss/<source>``), the order logs
``<run>/order_log/rank<r>.jsonl`` (``--data.order_log true``; one line per step and rank: document
pieces, tokens per source, target weights) and the saved ``config.yaml``; with the corpus reachable
(the config's source globs, or ``--corpus DIR``) also the manifest: which source each document is
from, documents and tokens per source. Each diagnostic gets a verdict:

1. **histogram** -- per-batch source histogram distance from the target weights over the run (mean,
   spread, by thirds of the run) and the cumulative shares at the end: FAIL when the mean per-batch
   distance exceeds ``batch_factor`` (2) x that of batches whose rows each hold one source drawn at
   random by weight (the scale's baseline: a batch of 4 rows cannot be flat; or ``max_batch_distance``
   when set), or the cumulative one exceeds ``max_cumulative_distance``.
2. **sawtooth** -- per-source train loss, detrended (a cubic in log step, the first 10% of steps left
   out), its periodogram: FAIL when one frequency holds more power than white noise gives it with
   probability ``alpha`` (the ratio to the mean power of the other frequencies exceeds ln(m / alpha)
   for m frequencies). A loss that follows the shards or chunks of a clustered corpus (a tiny buffer,
   no interleaving) saws with their period.
3. **epoch boundaries** -- at every step where a source starts a new epoch (its cumulative tokens cross
   a multiple of its corpus tokens): over ``window`` steps each side, a line in log(step) with a jump at
   the boundary, fitted by least squares: FAIL when the loss drops by more than ``k_se`` standard errors
   and ``min_drop`` nats (the model has seen the documents before, in the same order: a reused epoch
   order).
4. **rank overlap** -- per source-epoch, documents started on more than one rank (must be 0), and
   documents started twice within an epoch on one rank (must be 0). Epochs are estimated from the
   order: the i-th document start of a source falls in epoch floor(i / documents of the source); reads
   within ``margin`` starts of an epoch edge are not compared (consumers straddle the edge).
5. **implied epochs** -- tokens per source trained (order logs) against the tokens planned for the same
   steps (the logged target weights x tokens), and in epochs of the source: FAIL when a source differs
   by more than ``epoch_rtol`` of its plan plus one step's tokens.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from train.rundir import read_config, read_metrics, read_order_log, series

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Thresholds:
    max_batch_distance: float | None = None
    """Mean per-batch histogram distance (half the L1 distance of the shares from the weights); None:
    ``batch_factor`` x the distance of batches whose rows each hold one source drawn by weight
    (``iid_rows_distance``)."""
    batch_factor: float = 2.0
    """At 32 rows of 2,048 tokens random one-source rows give 0.10, so the limit is 0.21:
    row-parallel packing (0.13, simulated) passes, linear packing of long documents (0.35) fails."""
    max_cumulative_distance: float = 0.02
    """The same over all tokens trained: the mixer must hit the target in the long run."""
    alpha: float = 1e-3
    """Sawtooth: the false-alarm probability on white noise."""
    skip_frac: float = 0.1
    """Sawtooth: the first steps (warmup, the steep fall) left out."""
    window: int = 20
    """Epoch boundaries: steps before and after each boundary."""
    k_se: float = 3.0
    min_drop: float = 0.05
    """Epoch boundaries: nats/token."""
    epoch_rtol: float = 0.02


@dataclass
class Check:
    name: str
    status: str
    summary: str
    lines: list[str] = field(default_factory=list)
    """Markdown under the verdict (tables)."""
    plot: str | None = None


@dataclass
class Corpus:
    """What the order logs do not say: the source of each document, and each source's size."""

    source_of: Callable[[str], str | None]
    docs: dict[str, int]
    stream_tokens: dict[str, int]
    """Tokens one epoch of the source puts into sequences (text tokens + one EOT per document)."""
    margin: dict[str, int] = field(default_factory=dict)
    """Per rank: document starts near an epoch edge not compared in the overlap check, per source (times
    the number of ranks: consumers straddle an edge by about what each holds, its buffer and open chunks)."""


# -- reading -------------------------------------------------------------------------------------
def per_step_tokens(lines: list[dict], sources: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, tokens [steps, sources], target weights [steps, sources]) summed over ranks."""
    by_step: dict[int, list] = {}
    for d in lines:
        acc = by_step.setdefault(int(d["step"]), [np.zeros(len(sources)), None])
        acc[0] += [d["source_tokens"].get(s, 0) for s in sources]
        if d.get("weights"):
            acc[1] = np.array([d["weights"].get(s, 0.0) for s in sources])
    steps = np.array(sorted(by_step), dtype=int)
    tokens = np.array([by_step[s][0] for s in steps]).reshape(len(steps), len(sources))
    weights = np.array([by_step[s][1] if by_step[s][1] is not None else np.full(len(sources), np.nan)
                        for s in steps]).reshape(len(steps), len(sources))
    return steps, tokens, weights


def doc_starts(lines: list[dict]) -> list[tuple[int, int, str]]:
    """(step, rank, doc_id) of every document piece that starts a document (token offset 0), in order."""
    return [(int(d["step"]), int(d["rank"]), str(p[0])) for d in lines for p in d["pieces"] if int(p[1]) == 0]


# -- 1. per-batch histogram ------------------------------------------------------------------------
def share_distance(shares: np.ndarray, weights: np.ndarray) -> float:
    """Half the L1 distance between token shares and weights (0: on target, 1: disjoint)."""
    return 0.5 * float(np.abs(np.asarray(shares, float) - np.asarray(weights, float)).sum())


def cumulative_distance(tokens: np.ndarray, weights: np.ndarray) -> float:
    """Distance of all tokens trained from all tokens targeted (sum over steps of weights x tokens)."""
    total = tokens.sum()
    target = (weights * tokens.sum(axis=1, keepdims=True)).sum(axis=0)
    return share_distance(tokens.sum(axis=0) / total, target / max(target.sum(), 1e-12))


def iid_rows_distance(weights: np.ndarray, rows: int, draws: int = 4000, seed: int = 0) -> float:
    """Expected share distance of a batch of ``rows`` rows, each all one source drawn with probability
    ``weights``: what a batch gets with no mixing within rows (and each row's source independent)."""
    w = np.clip(np.asarray(weights, float), 0, None)
    w = w / w.sum()
    counts = np.random.default_rng(seed).multinomial(max(int(rows), 1), w, size=draws)
    return float(0.5 * np.abs(counts / max(int(rows), 1) - w).sum(axis=1).mean())


def check_histogram(distances: list[tuple[int, float]], cumulative: float | None, th: Thresholds,
                    baseline: float | None = None) -> Check:
    vals = np.array([v for _, v in distances if not math.isnan(v)])
    if not len(vals):
        return Check("per-batch source histogram", SKIP, "no `train/share_distance` in the CSV log")
    thirds = np.array_split(vals, 3) if len(vals) >= 3 else [vals]
    lines = ["| part of the run | steps | mean | std | p95 | max |", "|---|---:|---:|---:|---:|---:|"]
    for name, part in zip(("first third", "middle third", "last third") if len(thirds) == 3 else ("all",), thirds):
        lines.append(f"| {name} | {len(part)} | {part.mean():.4f} | {part.std():.4f} | "
                     f"{np.percentile(part, 95):.4f} | {part.max():.4f} |")
    lines.append(f"| **whole run** | {len(vals)} | {vals.mean():.4f} | {vals.std():.4f} | "
                 f"{np.percentile(vals, 95):.4f} | {vals.max():.4f} |")
    bad = []
    limit, what = histogram_limit(th, baseline)
    if limit is not None and vals.mean() > limit:
        bad.append(f"mean per-batch distance {vals.mean():.3f} > {limit:.3f} ({what})")
    if cumulative is not None and cumulative > th.max_cumulative_distance:
        bad.append(f"cumulative distance {cumulative:.4f} > {th.max_cumulative_distance:g}")
    cum = "" if cumulative is None else f"; all tokens trained vs targeted: {cumulative:.4f}"
    summary = (f"per-batch distance from the target mean {vals.mean():.4f} ± {vals.std():.4f} (std){cum}"
               + (": " + "; ".join(bad) if bad else
                  f" (limits: {'–' if limit is None else f'{limit:.3f}'} per batch, {what}; "
                  f"{th.max_cumulative_distance:g} cumulative)"))
    return Check("per-batch source histogram", FAIL if bad else PASS, summary, lines)


def histogram_limit(th: Thresholds, baseline: float | None) -> tuple[float | None, str]:
    """The mean per-batch distance the histogram check judges against (None: no limit), and where it
    comes from (diag_histogram.png draws it)."""
    if th.max_batch_distance is not None:
        return th.max_batch_distance, "set"
    if baseline is None:
        return None, "no baseline without the order log"
    limit = th.batch_factor * baseline
    return limit, f"{th.batch_factor:g} x {baseline:.3f}, batches of rows of one random source each"


def histogram_baseline(lines: list[dict], weights: np.ndarray) -> float | None:
    """``iid_rows_distance`` at the run's rows per step (summed over ranks), averaged over its steps'
    weights (each distinct weight vector once per step that has it)."""
    if not lines or not len(weights) or np.isnan(weights).any():
        return None
    rows_per_step: dict[int, int] = defaultdict(int)
    for d in lines:
        rows_per_step[int(d["step"])] += round(sum(d["source_tokens"].values()) / max(int(d["seq_len"]), 1))
    rows = int(np.median(list(rows_per_step.values())))
    distinct, counts = np.unique(np.round(weights, 4), axis=0, return_counts=True)
    return float(sum(c * iid_rows_distance(w, rows) for w, c in zip(distinct, counts)) / counts.sum())


# -- 2. sawtooth -----------------------------------------------------------------------------------
def regular(points: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """A series on a regular grid of its (median) step spacing; gaps and NaNs interpolated."""
    pts = [(s, v) for s, v in points if not math.isnan(v)]
    if len(pts) < 2:
        return np.array([]), np.array([])
    steps, vals = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    spacing = max(1.0, float(np.median(np.diff(steps))))
    grid = np.arange(steps[0], steps[-1] + spacing / 2, spacing)
    return grid, np.interp(grid, steps, vals)


def detrend(steps: np.ndarray, values: np.ndarray, degree: int = 3) -> np.ndarray:
    x = np.log1p(steps - steps[0])
    coef = np.polyfit(x, values, min(degree, len(values) - 1))
    return values - np.polyval(coef, x)


@dataclass
class Periodogram:
    ratio: float
    """Power of the strongest frequency over the mean power of the others."""
    threshold: float
    period: float
    """Of the strongest frequency, in steps."""
    n: int

    @property
    def periodic(self) -> bool:
        return self.ratio > self.threshold


def sawtooth_score(points: list[tuple[int, float]], alpha: float = 1e-3, skip_frac: float = 0.1) -> Periodogram | None:
    """The strongest periodic component of a detrended loss series, against white noise."""
    steps, vals = regular(points)
    if len(vals) < 16:
        return None
    keep = steps >= steps[0] + skip_frac * (steps[-1] - steps[0])
    steps, vals = steps[keep], vals[keep]
    if len(vals) < 16:
        return None
    resid = detrend(steps, vals)
    power = np.abs(np.fft.rfft(resid - resid.mean())) ** 2
    n = len(resid)
    lo = 3  # periods longer than a third of the series: what the trend fit leaves over
    band = power[lo:n // 2 if n % 2 == 0 else n // 2 + 1]
    if len(band) < 4:
        return None
    i = int(np.argmax(band))
    rest = np.delete(band, i)
    ratio = float(band[i] / max(rest.mean(), 1e-30))
    spacing = float(steps[1] - steps[0])
    return Periodogram(ratio, math.log(len(band) / alpha), n * spacing / (i + lo), n)


def check_sawtooth(losses: dict[str, list[tuple[int, float]]], th: Thresholds) -> Check:
    lines = ["| source | points | strongest period (steps) | power / mean of the rest | threshold | |",
             "|---|---:|---:|---:|---:|---|"]
    bad, tested = [], 0
    for source, pts in losses.items():
        p = sawtooth_score(pts, th.alpha, th.skip_frac)
        if p is None:
            n = sum(not math.isnan(v) for _, v in pts)
            lines.append(f"| {source} | {n} | – | – | – | too short (16 steps with the source needed) |")
            continue
        tested += 1
        if p.periodic:
            bad.append(f"{source} (period {p.period:.1f} steps, {p.ratio:.1f} x)")
        lines.append(f"| {source} | {p.n} | {p.period:.1f} | {p.ratio:.1f} | {p.threshold:.1f} | "
                     f"{'**SAWTOOTH**' if p.periodic else 'smooth'} |")
    if not tested:
        return Check("per-source loss smoothness", SKIP, "no per-source loss series long enough (16 points)", lines)
    summary = ("periodic per-source loss: " + ", ".join(bad) if bad else
               f"no periodic component above white noise (false-alarm rate {th.alpha:g}) in {tested} source(s)")
    return Check("per-source loss smoothness", FAIL if bad else PASS, summary, lines)


# -- 3. epoch boundaries ---------------------------------------------------------------------------
def epoch_boundaries(steps: np.ndarray, tokens: np.ndarray, epoch_tokens: float) -> list[tuple[int, int]]:
    """(epoch, step) for epoch >= 1: the first step that trains tokens of the epoch (its cumulative tokens
    exceed epoch x epoch_tokens)."""
    if epoch_tokens <= 0:
        return []
    cum = np.cumsum(tokens)
    out, e = [], 1
    for st, c in zip(steps, cum):
        while c > e * epoch_tokens:
            out.append((e, int(st)))
            e += 1
    return out


def boundary_drop(points: list[tuple[int, float]], boundary: int, window: int) -> tuple[float, float] | None:
    """How far the loss falls at ``boundary``, beyond its trend: over the ``window`` steps on each side,
    loss = a + b log(1 + step) - drop x [step >= boundary] by least squares. (drop, its standard error);
    None without 5 logged points on each side."""
    pts = [(s, v) for s, v in points if boundary - window <= s < boundary + window and not math.isnan(v)]
    before = sum(s < boundary for s, _ in pts)
    if before < 5 or len(pts) - before < 5:
        return None
    x, y = np.array(pts, float).T
    design = np.column_stack([np.ones_like(x), np.log1p(x), (x >= boundary).astype(float)])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    sigma2 = float(resid @ resid) / max(len(y) - 3, 1)
    cov = sigma2 * np.linalg.inv(design.T @ design)
    return float(-coef[2]), math.sqrt(max(float(cov[2, 2]), 0.0))


def check_boundaries(losses: dict[str, list[tuple[int, float]]], boundaries: dict[str, list[tuple[int, int]]],
                     th: Thresholds) -> Check:
    lines = ["| source | epoch | starts at step | drop vs the trend (nats) | SE | |", "|---|---:|---:|---:|---:|---|"]
    bad, tested = [], 0
    for source, bounds in boundaries.items():
        for epoch, step in bounds:
            r = boundary_drop(losses.get(source, []), step, th.window)
            if r is None:
                lines.append(f"| {source} | {epoch} | {step:,} | – | – | too close to an end |")
                continue
            tested += 1
            drop, se = r
            fell = drop > th.k_se * se and drop > th.min_drop
            if fell:
                bad.append(f"{source} epoch {epoch} at step {step:,} ({drop:+.3f} nats)")
            lines.append(f"| {source} | {epoch} | {step:,} | {drop:+.4f} | {se:.4f} | {'**DROP**' if fell else 'ok'} |")
    if not boundaries:
        return Check("loss across epoch boundaries", SKIP, "corpus sizes unknown: epochs not located")
    if not any(boundaries.values()):
        return Check("loss across epoch boundaries", SKIP, "no source started a new epoch in this run")
    if not tested:
        return Check("loss across epoch boundaries", SKIP,
                     f"no epoch boundary {th.window} steps (and 5 logged losses) away from the run's ends", lines)
    summary = ("the loss drops when a source starts a new epoch: " + ", ".join(bad) if bad else
               f"no drop at {tested} epoch boundary(ies) (limit {th.k_se:g} SE and {th.min_drop:g} nats)")
    return Check("loss across epoch boundaries", FAIL if bad else PASS, summary, lines)


# -- 4. rank overlap ---------------------------------------------------------------------------------
@dataclass
class Overlap:
    epochs: int
    starts: int
    overlaps: int
    """Documents started on two or more ranks within one epoch."""
    repeats: int
    """Documents started twice on one rank within one epoch."""
    compared: int
    """Starts away from the epoch edges (the ones compared)."""
    examples: list[str]


def epoch_overlap(starts: list[tuple[int, int, str]], n_docs: int, margin: int = 0) -> Overlap:
    """Starts of one source in order; epoch of the i-th start = i // n_docs."""
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    compared = 0
    for i, (_, rank, doc) in enumerate(starts):
        pos = i % n_docs
        # near an epoch's end the leading consumers are already in the next epoch; near its start (from
        # epoch 1 on) the lagging ones are still in the previous one
        if margin and (pos >= n_docs - margin or (i >= n_docs and pos < margin)):
            continue
        compared += 1
        groups[(i // n_docs, doc)].append(rank)
    overlaps = repeats = 0
    examples = []
    for (epoch, doc), ranks in groups.items():
        if len(ranks) < 2:
            continue
        if len(set(ranks)) > 1:
            overlaps += 1
            if len(examples) < 3:
                examples.append(f"`{doc}` on ranks {sorted(set(ranks))} in epoch {epoch}")
        if len(ranks) > len(set(ranks)):
            repeats += 1
            if len(examples) < 3:
                examples.append(f"`{doc}` twice on one rank in epoch {epoch}")
    epochs = (len(starts) + n_docs - 1) // n_docs if n_docs else 0
    return Overlap(epochs, len(starts), overlaps, repeats, compared, examples)


def check_overlap(starts: list[tuple[int, int, str]], corpus: Corpus | None) -> Check:
    name = "document overlap between ranks per source-epoch"
    if corpus is None:
        return Check(name, SKIP, "corpus not found: documents cannot be assigned to sources (use --corpus DIR)")
    by_source: dict[str, list] = defaultdict(list)
    unknown = 0
    for st in starts:
        s = corpus.source_of(st[2])
        if s is None:
            unknown += 1
        else:
            by_source[s].append(st)
    ranks = sorted({r for _, r, _ in starts})
    lines = ["| source | documents | starts | epochs (part) | compared | on 2+ ranks | twice on a rank | |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    bad, examples, compared = [], [], 0
    for source, n in corpus.docs.items():
        o = epoch_overlap(by_source.get(source, []), n, corpus.margin.get(source, 0) * len(ranks))
        compared += o.compared
        if o.overlaps or o.repeats:
            bad.append(f"{source}: {o.overlaps} on 2+ ranks, {o.repeats} repeated")
            examples += o.examples
        lines.append(f"| {source} | {n:,} | {o.starts:,} | {o.starts / max(n, 1):.2f} | {o.compared:,} | "
                     f"{o.overlaps} | {o.repeats} | {'**OVERLAP**' if o.overlaps or o.repeats else 'ok'} |")
    if unknown:
        lines.append("")
        lines.append(f"{unknown} document start(s) of no known source (a different corpus?) left out.")
    if examples:
        lines.append("")
        lines.append("For example: " + "; ".join(examples[:3]) + ".")
    if not compared:
        return Check(name, SKIP, "no document start far enough from an epoch edge to compare", lines)
    summary = (f"documents read twice within a source-epoch over {len(ranks)} rank(s): " + "; ".join(bad) if bad
               else f"0 documents read twice within a source-epoch over {len(ranks)} rank(s)")
    return Check(name, FAIL if bad else PASS, summary, lines)


# -- 5. implied epochs -------------------------------------------------------------------------------
def check_epochs(sources: list[str], tokens: np.ndarray, weights: np.ndarray, corpus: Corpus | None,
                 planned_run: dict[str, float] | None, th: Thresholds) -> Check:
    name = "implied epochs: realised vs planned"
    if not len(tokens):
        return Check(name, SKIP, "no order log")
    per_step = tokens.sum(axis=1)
    planned = (weights * per_step[:, None]).sum(axis=0)
    realised = tokens.sum(axis=0)
    step_tokens = float(per_step.max())
    head = "| source | planned (these steps) | realised | difference | tolerance |"
    sep = "|---|---:|---:|---:|---:|"
    if corpus is not None:
        head += " epochs planned | epochs realised |"
        sep += "---:|---:|"
    if planned_run:
        head += " epochs over the whole schedule |" if corpus is not None else " planned over the whole schedule |"
        sep += "---:|"
    lines = [head + " |", sep + "---|"]
    bad = []
    for j, s in enumerate(sources):
        tol = th.epoch_rtol * planned[j] + step_tokens
        ok = abs(realised[j] - planned[j]) <= tol
        if not ok:
            bad.append(f"{s} ({realised[j] - planned[j]:+,.0f} tokens)")
        row = (f"| {s} | {planned[j]:,.0f} | {realised[j]:,.0f} | {realised[j] - planned[j]:+,.0f} | {tol:,.0f} |")
        if corpus is not None:
            e = max(corpus.stream_tokens.get(s, 0), 1)
            row += f" {planned[j] / e:.3f} | {realised[j] / e:.3f} |"
        if planned_run:
            if corpus is not None:
                row += f" {planned_run.get(s, 0) / max(corpus.stream_tokens.get(s, 0), 1):.3f} |"
            else:
                row += f" {planned_run.get(s, 0):,.0f} |"
        lines.append(row + f" {'ok' if ok else '**OFF PLAN**'} |")
    if np.isnan(planned).any():
        return Check(name, SKIP, "the order log has no target weights", lines)
    summary = ("tokens per source off the plan: " + ", ".join(bad) if bad else
               f"every source within {th.epoch_rtol:g} of its plan + one step's tokens"
               + ("" if corpus is not None else " (corpus not found: tokens only, no epochs)"))
    return Check(name, FAIL if bad else PASS, summary, lines)


# -- the run -------------------------------------------------------------------------------------------
def corpus_of(config: dict, corpus_dir: Path | None = None, roots: tuple[Path, ...] = ()) -> Corpus | None:
    """The manifest of the run's corpus (its config's source globs, or ``corpus_dir``); None if not found."""

    from data.config import corpus_sources, parse_data_config
    from data.errors import ConfigError
    from data.manifest import build_manifest

    section = dict(config.get("data") or {})
    names = list(section.get("sources") or {})
    cwd = os.getcwd()
    for root in (roots or (Path(cwd),)):
        try:
            os.chdir(root)  # relative globs in a saved config are relative to where the run started
            if corpus_dir is not None:
                section["sources"] = {n: {"paths": [str(p) for p in src.paths]}
                                      for n, src in corpus_sources(Path(cwd) / corpus_dir, names).items()}
            manifest = build_manifest(parse_data_config(section, origin="config.yaml"))
            break
        except (ConfigError, FileNotFoundError, OSError, ValueError, TypeError, KeyError):
            continue
        finally:
            os.chdir(cwd)
    else:
        return None
    stem_source: dict[str, str | None] = {}
    for name, src in manifest.sources.items():
        for shard in src.shards:
            stem = manifest.shards[shard].stem
            # a file that feeds two sources (filters on a column): its documents' source is not in the log
            stem_source[stem] = name if stem_source.get(stem, name) == name else None
    workers = max(1, int(section.get("num_workers") or 1))
    buffer = int(section.get("buffer_size") or 0)
    margins = {}
    for name, src in manifest.sources.items():
        per_chunk = src.docs / max(len(src.chunks), 1)
        margins[name] = int(workers * (buffer + int(section.get("open_shards") or 1) * per_chunk))

    def source_of(doc_id: str) -> str | None:
        return stem_source.get(doc_id.rsplit(":", 1)[0])

    return Corpus(source_of, {n: s.docs for n, s in manifest.sources.items()},
                  {n: s.stream_tokens for n, s in manifest.sources.items()}, margins)


def diagnose(run_dir: Path, corpus: Corpus | None = None, th: Thresholds | None = None,
             planned_run: dict[str, float] | None = None) -> tuple[list[Check], dict]:
    """The five checks of one run; also the series they read (for the plots)."""
    th = th or Thresholds()
    rows = read_metrics(run_dir)
    sources = sorted({k.split("/", 2)[2] for r in rows[:1] for k in r if k.startswith("train/loss/")})
    lines = read_order_log(run_dir, required=False)
    if lines:
        sources = list(lines[0]["source_tokens"]) or sources
    losses = {s: series(rows, f"train/loss/{s}") for s in sources}
    distances = series(rows, "train/share_distance")
    steps, tokens, weights = per_step_tokens(lines, sources) if lines else (np.array([]), np.zeros((0, 0)),
                                                                            np.zeros((0, 0)))
    cumulative = cumulative_distance(tokens, weights) if len(steps) and not np.isnan(weights).any() else None
    boundaries = {}
    if corpus is not None and len(steps):
        # the step a logged micro-batch counts toward: order-log steps are data steps, the CSV's optimizer steps
        accum = max(1, round(len(steps) / max(1, max((s for s, _ in distances), default=len(steps) - 1) + 1)))
        boundaries = {s: [(e, int(st) // accum) for e, st in epoch_boundaries(steps, tokens[:, j],
                                                                             corpus.stream_tokens.get(s, 0))]
                      for j, s in enumerate(sources)}
    baseline = histogram_baseline(lines, weights)
    checks = [
        check_histogram(distances, cumulative, th, baseline),
        check_sawtooth(losses, th),
        check_boundaries(losses, boundaries, th) if corpus is not None else
        Check("loss across epoch boundaries", SKIP, "corpus not found: epochs not located (use --corpus DIR)"),
        check_overlap(doc_starts(lines), corpus) if lines else
        Check("document overlap between ranks per source-epoch", SKIP, "no order log (--data.order_log true)"),
        check_epochs(sources, tokens, weights, corpus, planned_run, th) if lines else
        Check("implied epochs: realised vs planned", SKIP, "no order log (--data.order_log true)"),
    ]
    return checks, {"losses": losses, "distances": distances, "boundaries": boundaries, "steps": steps,
                    "tokens": tokens, "weights": weights, "sources": sources,
                    "histogram_limit": histogram_limit(th, baseline)}


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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {}
    from data.files import atomic_path

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


def render(run_dir: Path, checks: list[Check], plots: dict[str, str], corpus_note: str) -> str:
    failed = [c for c in checks if c.status == FAIL]
    md = [f"# Run diagnostics: {Path(run_dir).name}", "",
          f"From `{run_dir}`: the CSV log, the order logs and the saved config. {corpus_note}", "",
          f"**{'FAIL' if failed else 'PASS'}**: " + (", ".join(c.name for c in failed) + " failed."
                                                     if failed else "every diagnostic that could run passed."),
          "", "| diagnostic | verdict | summary |", "|---|---|---|"]
    md += [f"| {c.name} | {'**FAIL**' if c.status == FAIL else c.status} | {c.summary} |" for c in checks]
    md.append("")
    for i, c in enumerate(checks, 1):
        md += [f"## {i}. {c.name}: {c.status}", "", c.summary + ".", ""]
        if c.lines:
            md += c.lines + [""]
        if i == 1 and "histogram" in plots:
            md += [f"![per-batch histogram distance]({plots['histogram']})", ""]
        if i == 2 and "loss" in plots:
            md += [f"![per-source train loss]({plots['loss']})", ""]
    md.append("How each diagnostic is computed and what makes it fail: docs/diagnostics.md.")
    md.append("")
    return "\n".join(md)


def write_report(run_dir: Path, out: Path | None = None, corpus_dir: Path | None = None,
                 th: Thresholds | None = None, plots: bool = True) -> tuple[Path, list[Check]]:
    """Diagnose ``run_dir`` and write ``out`` (default RUN/diagnostics.md) atomically, plots beside it."""
    from ablations.outcomes import planned_tokens
    from data.files import write_text

    run_dir = Path(run_dir)
    root = Path(__file__).resolve().parents[1]
    try:
        config = read_config(run_dir)
    except FileNotFoundError:
        config = {}
    corpus = corpus_of(config, corpus_dir, (Path.cwd(), root)) if config or corpus_dir else None
    try:
        planned_run = planned_tokens(config) if config else None
    except (KeyError, TypeError, ValueError):
        planned_run = None
    checks, data = diagnose(run_dir, corpus, th, planned_run)
    out = Path(out) if out else run_dir / "diagnostics.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    pics = write_plots(out.parent, data) if plots else {}
    note = ("Corpus: found (documents and tokens per source from its manifest)." if corpus is not None else
            "Corpus: not found, so the checks that need document sources or corpus sizes are skipped.")
    write_text(out, render(run_dir, checks, pics, note))
    return out, checks
