"""Does the shuffle mix? Five diagnostics of one training run, from its logs; what each computes and
what makes it fail: docs/diagnostics.md.

    python scripts/diagnose_run.py runs/demo            # writes runs/demo/diagnostics.md and its plots

Reads ``<run>/csv/metrics.csv``, the order logs (``--data.order_log true``) and the saved ``config.yaml``;
with the corpus reachable (the config's source globs, or ``--corpus DIR``) also its manifest. Each check
(the per-batch source histogram, a sawtooth in a source's loss, a loss drop at a source's new epoch,
documents read twice within a source-epoch, tokens per source against the plan) gets PASS, FAIL, or
SKIP with the reason when its inputs are missing or too few. The cumulative distance and the planned
tokens each allow one step's tokens (the deficit selector keeps a source within about that of its target).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ablations.diagnose_plots import write_plots
from data.config import corpus_sources, parse_data_config
from data.errors import ConfigError
from data.files import write_text
from data.manifest import build_manifest
from train.rundir import read_config, read_metrics, read_order_log, series

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Thresholds:
    max_batch_distance: float | None = None
    """Mean per-batch histogram distance (half the L1 distance of the shares from the weights); None:
    ``batch_factor`` x the distance of batches whose rows each hold one source drawn by weight
    (``iid_rows_distance``)."""
    batch_factor: float = 2.0
    """0.21 at 32 rows of 2,048 tokens: row-parallel packing passes, linear packing fails (docs/diagnostics.md)."""
    max_cumulative_distance: float = 0.02
    """The same over all tokens trained, plus one step's share of them (``1 / steps``: the mixer can trail
    its target by about what one step holds, module doc)."""
    min_steps: int = 10
    """Histogram: fewer logged steps are SKIP (a short or killed run); the mean of fewer batches is noise."""
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


def cumulative_distance(tokens: np.ndarray, weights: np.ndarray) -> float | None:
    """Distance of all tokens trained from all tokens targeted (sum over steps of weights x tokens); None
    without any."""
    total = tokens.sum()
    if not total:
        return None
    target = (weights * tokens.sum(axis=1, keepdims=True)).sum(axis=0)
    return share_distance(tokens.sum(axis=0) / total, target / max(target.sum(), 1e-12))


def iid_rows_distance(weights: np.ndarray, rows: int, draws: int = 4000, seed: int = 0) -> float:
    """Expected share distance of a batch of ``rows`` rows, each all one source drawn with probability
    ``weights``: what a batch gets with no mixing within rows (and each row's source independent)."""
    w = np.clip(np.asarray(weights, float), 0, None)
    w = w / w.sum()
    counts = np.random.default_rng(seed).multinomial(max(int(rows), 1), w, size=draws)
    return float(0.5 * np.abs(counts / max(int(rows), 1) - w).sum(axis=1).mean())


def _verdict(name: str, bad: list[str], failed: str, passed: str, lines: list[str], sep: str = ", ") -> Check:
    """FAIL saying ``failed`` and what was wrong, or PASS saying ``passed``."""
    return Check(name, FAIL, failed + sep.join(bad), lines) if bad else Check(name, PASS, passed, lines)


def check_histogram(distances: list[tuple[int, float]], cumulative: float | None, th: Thresholds,
                    baseline: float | None = None, step_share: float = 0.0) -> Check:
    """``step_share``: one step's tokens over all tokens trained, what the cumulative limit adds (module doc)."""
    name = "per-batch source histogram"
    vals = np.array([v for _, v in distances if not math.isnan(v)])
    if len(vals) < th.min_steps:
        return Check(name, SKIP, f"{len(vals)} step(s) with `train/share_distance` in the CSV log: too few to "
                                 f"judge a mean (at least {th.min_steps})")
    limit, what = histogram_limit(th, baseline)
    cum_limit = th.max_cumulative_distance + step_share
    bad = [f"mean per-batch distance {vals.mean():.3f} > {limit:.3f} ({what})"] if vals.mean() > (
        math.inf if limit is None else limit) else []
    if (cumulative or 0.0) > cum_limit:
        bad.append(f"cumulative distance {cumulative:.4f} > {cum_limit:.4f} ({th.max_cumulative_distance:g} + one "
                   f"step's share of the tokens, {step_share:.4f})")
    cum = "" if cumulative is None else f"; all tokens trained vs targeted: {cumulative:.4f}"
    head = f"per-batch distance from the target mean {vals.mean():.4f} ± {vals.std():.4f} (std){cum}"
    shown = "–" if limit is None else f"{limit:.3f}"
    return _verdict(name, bad, head + ": ", f"{head} (limits: {shown} per batch, {what}; {cum_limit:.4f} cumulative)",
                    _spread_table(vals), sep="; ")


def _spread_table(vals: np.ndarray) -> list[str]:
    """Mean, std, p95 and max of the per-batch distance, by thirds of the run and over all of it."""
    parts = dict(zip(("first third", "middle third", "last third"), np.array_split(vals, 3)))
    lines = ["| part of the run | steps | mean | std | p95 | max |", "|---|---:|---:|---:|---:|---:|"]
    for name, part in {**parts, "**whole run**": vals}.items():
        lines.append(f"| {name} | {len(part)} | {part.mean():.4f} | {part.std():.4f} | "
                     f"{np.percentile(part, 95):.4f} | {part.max():.4f} |")
    return lines


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
    if len(vals) >= 16:
        keep = steps >= steps[0] + skip_frac * (steps[-1] - steps[0])
        steps, vals = steps[keep], vals[keep]
    lo, n = 3, len(vals)  # lo: periods longer than a third of the series are what the trend fit leaves over
    if n < 16:
        return None
    resid = detrend(steps, vals)
    band = (np.abs(np.fft.rfft(resid - resid.mean())) ** 2)[lo:(n + 1) // 2]
    i = int(np.argmax(band))
    ratio = float(band[i] / max(np.delete(band, i).mean(), 1e-30))
    return Periodogram(ratio, math.log(len(band) / alpha), n * float(steps[1] - steps[0]) / (i + lo), n)


def check_sawtooth(losses: dict[str, list[tuple[int, float]]], th: Thresholds) -> Check:
    lines = ["| source | points | strongest period (steps) | power / mean of the rest | threshold | |",
             "|---|---:|---:|---:|---:|---|"]
    scores = {source: sawtooth_score(pts, th.alpha, th.skip_frac) for source, pts in losses.items()}
    lines += [_sawtooth_row(source, p, losses[source]) for source, p in scores.items()]
    tested = {s: p for s, p in scores.items() if p is not None}
    if not tested:
        return Check("per-source loss smoothness", SKIP, "no per-source loss series long enough (16 points)", lines)
    return _verdict("per-source loss smoothness", [f"{s} (period {p.period:.1f} steps, {p.ratio:.1f} x)" for s, p in
                                                   tested.items() if p.periodic],
                    "periodic per-source loss: ", f"no periodic component above white noise (false-alarm rate "
                    f"{th.alpha:g}) in {len(tested)} source(s)", lines)


def _sawtooth_row(source: str, p: Periodogram | None, points: list[tuple[int, float]]) -> str:
    if p is None:
        n = sum(not math.isnan(v) for _, v in points)
        return f"| {source} | {n} | – | – | – | too short (16 steps with the source needed) |"
    return (f"| {source} | {p.n} | {p.period:.1f} | {p.ratio:.1f} | {p.threshold:.1f} | "
            f"{'**SAWTOOTH**' if p.periodic else 'smooth'} |")


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
    name = "loss across epoch boundaries"
    if not any(boundaries.values()):
        return Check(name, SKIP, "no source started a new epoch in this run" if boundaries else
                     "epochs not located (no order log, or the corpus not found: use --corpus DIR)")
    lines = ["| source | epoch | starts at step | drop vs the trend (nats) | SE | |", "|---|---:|---:|---:|---:|---|"]
    rows = [_boundary_row(losses.get(s, []), s, e, st, th) for s, bounds in boundaries.items() for e, st in bounds]
    lines += [line for line, _, _ in rows]
    bad, tested = [b for _, b, _ in rows if b], sum(t for _, _, t in rows)
    if not tested:
        return Check(name, SKIP, f"no epoch boundary {th.window} steps (and 5 logged losses) away from the run's "
                                 "ends", lines)
    return _verdict(name, bad, "the loss drops when a source starts a new epoch: ", f"no drop at {tested} epoch "
                    f"boundary(ies) (limit {th.k_se:g} SE and {th.min_drop:g} nats)", lines)


def _boundary_row(points: list[tuple[int, float]], source: str, epoch: int, step: int,
                  th: Thresholds) -> tuple[str, str | None, bool]:
    """(its table row, the failure or None, whether it could be tested) for one epoch boundary."""
    r = boundary_drop(points, step, th.window)
    row = f"| {source} | {epoch} | {step:,} |"
    if r is None:
        return f"{row} – | – | too close to an end |", None, False
    fell = r[0] > th.k_se * r[1] and r[0] > th.min_drop
    return (f"{row} {r[0]:+.4f} | {r[1]:.4f} | {'**DROP**' if fell else 'ok'} |",
            f"{source} epoch {epoch} at step {step:,} ({r[0]:+.3f} nats)" if fell else None, True)


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
    groups = _by_epoch(starts, n_docs, margin)
    overlaps = [f"`{doc}` on ranks {sorted(set(ranks))} in epoch {e}" for (e, doc), ranks in groups.items()
                if len(set(ranks)) > 1]
    repeats = [f"`{doc}` twice on one rank in epoch {e}" for (e, doc), ranks in groups.items()
               if len(ranks) > len(set(ranks))]
    epochs = -(-len(starts) // max(n_docs, 1))
    return Overlap(epochs, len(starts), len(overlaps), len(repeats), sum(map(len, groups.values())),
                   (overlaps + repeats)[:3])


def _by_epoch(starts: list[tuple[int, int, str]], n_docs: int, margin: int) -> dict[tuple[int, str], list[int]]:
    """(epoch, document) -> the ranks that started it, leaving out starts within ``margin`` of an epoch edge:
    near an epoch's end the leading consumers are already in the next epoch; near its start (from epoch 1
    on) the lagging ones are still in the previous one."""
    groups: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, (_, rank, doc) in enumerate(starts):
        pos = i % n_docs
        if not margin or (pos < n_docs - margin and (i < n_docs or pos >= margin)):
            groups[(i // n_docs, doc)].append(rank)
    return groups


def check_overlap(starts: list[tuple[int, int, str]], corpus: Corpus | None) -> Check:
    name = "document overlap between ranks per source-epoch"
    if not starts:
        return Check(name, SKIP, "no order log (--data.order_log true)")
    if corpus is None:
        return Check(name, SKIP, "corpus not found: documents cannot be assigned to sources (use --corpus DIR)")
    by_source: dict[str | None, list] = defaultdict(list)
    for st in starts:
        by_source[corpus.source_of(st[2])].append(st)
    ranks = len({r for _, r, _ in starts})
    found = {source: epoch_overlap(by_source.get(source, []), n, corpus.margin.get(source, 0) * ranks)
             for source, n in corpus.docs.items()}
    lines = _overlap_table(found, corpus.docs, len(by_source.get(None, [])))
    if not sum(o.compared for o in found.values()):
        return Check(name, SKIP, "no document start far enough from an epoch edge to compare", lines)
    bad = [f"{s}: {o.overlaps} on 2+ ranks, {o.repeats} repeated" for s, o in found.items() if o.examples]
    return _verdict(name, bad, f"documents read twice within a source-epoch over {ranks} rank(s): ",
                    f"0 documents read twice within a source-epoch over {ranks} rank(s)", lines, sep="; ")


def _overlap_table(found: dict[str, Overlap], docs: dict[str, int], unknown: int) -> list[str]:
    lines = ["| source | documents | starts | epochs (part) | compared | on 2+ ranks | twice on a rank | |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for source, o in found.items():
        n = docs[source]
        lines.append(f"| {source} | {n:,} | {o.starts:,} | {o.starts / max(n, 1):.2f} | {o.compared:,} | "
                     f"{o.overlaps} | {o.repeats} | {'**OVERLAP**' if o.overlaps or o.repeats else 'ok'} |")
    if unknown:
        lines += ["", f"{unknown} document start(s) of no known source (a different corpus?) left out."]
    examples = [x for o in found.values() for x in o.examples]
    return lines + (["", "For example: " + "; ".join(examples[:3]) + "."] if examples else [])


# -- 5. implied epochs -------------------------------------------------------------------------------
def check_epochs(sources: list[str], tokens: np.ndarray, weights: np.ndarray, corpus: Corpus | None,
                 planned_run: dict[str, float] | None, th: Thresholds) -> Check:
    name = "implied epochs: realised vs planned"
    if not len(tokens):
        return Check(name, SKIP, "no order log (--data.order_log true)")
    per_step = tokens.sum(axis=1)
    planned, realised = (weights * per_step[:, None]).sum(axis=0), tokens.sum(axis=0)
    tol = th.epoch_rtol * planned + float(per_step.max())
    off = np.abs(realised - planned) > tol
    columns = {"source": sources, "planned (these steps)": _fmt(planned, ",.0f"), "realised": _fmt(realised, ",.0f"),
               "difference": _fmt(realised - planned, "+,.0f"), "tolerance": _fmt(tol, ",.0f")}
    columns.update(_epoch_columns(sources, planned, realised, planned_run, corpus))
    if not planned_run:
        columns.popitem()
    lines = _table({**columns, "": np.where(off, "**OFF PLAN**", "ok").tolist()})
    if np.isnan(planned).any():
        return Check(name, SKIP, "the order log has no target weights", lines)
    return _verdict(name, [f"{s} ({d:+,.0f} tokens)" for s, d, o in zip(sources, realised - planned, off) if o],
                    "tokens per source off the plan: ", f"every source within {th.epoch_rtol:g} of its plan + one "
                    "step's tokens" + ("" if corpus is not None else " (corpus not found: tokens only, no epochs)"),
                    lines)


def _epoch_columns(sources: list[str], planned: np.ndarray, realised: np.ndarray, planned_run: dict[str, float] | None,
                   corpus: Corpus | None) -> dict[str, list[str]]:
    """The tokens in epochs of each source (with the corpus), and last what the whole schedule plans."""
    whole = np.array([(planned_run or {}).get(s, 0) for s in sources], float)
    if corpus is None:
        return {"planned over the whole schedule": _fmt(whole, ",.0f")}
    epoch = np.array([max(corpus.stream_tokens.get(s, 0), 1) for s in sources])
    return {"epochs planned": _fmt(planned / epoch, ".3f"), "epochs realised": _fmt(realised / epoch, ".3f"),
            "epochs over the whole schedule": _fmt(whole / epoch, ".3f")}


def _fmt(values: np.ndarray, spec: str) -> list[str]:
    return [format(v, spec) for v in values]


def _table(columns: dict[str, list[str]]) -> list[str]:
    """A markdown table, the first and last columns left-aligned, the others right-aligned."""
    names = list(columns)
    align = ["---"] + ["---:"] * (len(names) - 2) + ["---"]
    return (["| " + " | ".join(names) + " |", "|" + "|".join(align) + "|"]
            + ["| " + " | ".join(row) + " |" for row in zip(*columns.values())])


# -- the run -------------------------------------------------------------------------------------------
def corpus_of(config: dict, corpus_dir: Path | None = None, roots: tuple[Path, ...] = ()) -> Corpus | None:
    """The manifest of the run's corpus (its config's source globs, or ``corpus_dir``); None if not found."""
    section = dict(config.get("data") or {})
    manifest = _manifest(section, corpus_dir, roots)
    if manifest is None:
        return None
    stem_source: dict[str, str | None] = {}
    for name, stem in ((n, manifest.shards[i].stem) for n, src in manifest.sources.items() for i in src.shards):
        # a file that feeds two sources (filters on a column): its documents' source is not in the log
        stem_source[stem] = name if stem_source.get(stem, name) == name else None
    return Corpus(lambda doc_id: stem_source.get(doc_id.rsplit(":", 1)[0]),
                  {n: s.docs for n, s in manifest.sources.items()},
                  {n: s.stream_tokens for n, s in manifest.sources.items()}, _margins(section, manifest))


def _margins(section: dict, manifest) -> dict[str, int]:
    """Per source, what one rank's consumers hold around an epoch edge: its workers' buffers and the
    documents of their open chunks."""
    workers, buffer = max(1, int(section.get("num_workers") or 1)), int(section.get("buffer_size") or 0)
    held = int(section.get("open_shards") or 1)
    return {name: int(workers * (buffer + held * src.docs / max(len(src.chunks), 1)))
            for name, src in manifest.sources.items()}


def _manifest(section: dict, corpus_dir: Path | None, roots: tuple[Path, ...]):
    """The manifest of a saved config's data section, its relative globs taken from each of ``roots`` in
    turn (where the run started; default: here); ``corpus_dir`` replaces the sources' globs."""
    cwd = os.getcwd()
    for root in (roots or (Path(cwd),)):
        try:
            os.chdir(root)
            if corpus_dir is not None:
                found = corpus_sources(Path(cwd) / corpus_dir, list(section.get("sources") or {}))
                section["sources"] = {n: {"paths": [str(p) for p in src.paths]} for n, src in found.items()}
            return build_manifest(parse_data_config(section, origin="config.yaml"))
        except (ConfigError, FileNotFoundError, OSError, ValueError, TypeError, KeyError):
            continue
        finally:
            os.chdir(cwd)
    return None


def diagnose(run_dir: Path, corpus: Corpus | None = None, th: Thresholds | None = None,
             planned_run: dict[str, float] | None = None) -> tuple[list[Check], dict]:
    """The five checks of one run; also the series they read (for the plots)."""
    th = th or Thresholds()
    rows = read_metrics(run_dir)
    lines = read_order_log(run_dir, required=False)
    sources = list(lines[0]["source_tokens"]) if lines else []
    sources = sources or sorted(k.split("/", 2)[2] for k in (rows or [{}])[0] if k.startswith("train/loss/"))
    losses = {s: series(rows, f"train/loss/{s}") for s in sources}
    distances = series(rows, "train/share_distance")
    steps, tokens, weights = per_step_tokens(lines, sources)
    per_step = tokens.sum(axis=1)
    cumulative = None if np.isnan(weights).any() else cumulative_distance(tokens, weights)
    boundaries = _boundaries(steps, tokens, sources, corpus, distances) if corpus is not None else {}
    baseline = histogram_baseline(lines, weights)
    checks = [
        check_histogram(distances, cumulative, th, baseline, float(per_step.max(initial=0) / max(per_step.sum(), 1))),
        check_sawtooth(losses, th),
        check_boundaries(losses, boundaries, th),
        check_overlap(doc_starts(lines), corpus),
        check_epochs(sources, tokens, weights, corpus, planned_run, th),
    ]
    return checks, {"losses": losses, "distances": distances, "boundaries": boundaries, "steps": steps,
                    "tokens": tokens, "weights": weights, "sources": sources,
                    "histogram_limit": histogram_limit(th, baseline)}


def _boundaries(steps: np.ndarray, tokens: np.ndarray, sources: list[str], corpus: Corpus,
                distances: list[tuple[int, float]]) -> dict[str, list[tuple[int, int]]]:
    """Per source, (epoch, optimizer step) where it starts a new epoch. Order-log steps are data steps
    (micro-batches), the CSV's optimizer steps: a logged micro-batch counts toward step // accumulation."""
    accum = max(1, round(len(steps) / max(1, max((s for s, _ in distances), default=len(steps) - 1) + 1)))
    epochs = {s: epoch_boundaries(steps, tokens[:, j], corpus.stream_tokens.get(s, 0)) for j, s in enumerate(sources)}
    return {s: [(e, int(st) // accum) for e, st in found] for s, found in epochs.items()} if len(steps) else {}


def render(run_dir: Path, checks: list[Check], plots: dict[str, str], corpus_note: str) -> str:
    failed = ", ".join(c.name for c in checks if c.status == FAIL)
    pictures = {1: ("per-batch histogram distance", plots.get("histogram")), 2: ("per-source train loss",
                                                                                 plots.get("loss"))}
    md = [f"# Run diagnostics: {Path(run_dir).name}", "",
          f"From `{run_dir}`: the CSV log, the order logs and the saved config. {corpus_note}", "",
          f"**FAIL**: {failed} failed." if failed else "**PASS**: every diagnostic that could run passed.",
          "", "| diagnostic | verdict | summary |", "|---|---|---|"]
    md += [f"| {c.name} | {'**FAIL**' if c.status == FAIL else c.status} | {c.summary} |" for c in checks]
    for i, c in enumerate(checks, 1):
        alt, png = pictures.get(i, ("", None))
        md += ["", f"## {i}. {c.name}: {c.status}", "", c.summary + "."] + ([""] + c.lines if c.lines else []) \
            + (["", f"![{alt}]({png})"] if png else [])
    return "\n".join(md + ["", "How each diagnostic is computed and what makes it fail: docs/diagnostics.md.", ""])


def write_report(run_dir: Path, out: Path | None = None, corpus_dir: Path | None = None,
                 th: Thresholds | None = None, plots: bool = True) -> tuple[Path, list[Check]]:
    """Diagnose ``run_dir`` and write ``out`` (default RUN/diagnostics.md) atomically, plots beside it."""
    from ablations.outcomes import planned_tokens

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
