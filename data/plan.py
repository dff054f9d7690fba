"""Plan a run before spending compute: tokens and epochs per source, a printed table, a plot.

The schedule says how many tokens each source gives; the corpus manifest says how many it has.
Their ratio is the number of epochs a source will be repeated, which is worth knowing before
step 0 (curated data repeated 10 times is a different experiment)::

    schedule = ScheduleConfig.from_dict(cfg["schedule"]).build()
    check_epochs(schedule, available_tokens, max_epochs=4.0)   # warns per over-repeated source
    lr = LRConfig().build(schedule.total_steps, schedule.anneal_step)   # the module's model.lr
    print(plan_table(schedule, available_tokens, lr))
    plot_schedule(schedule, lr, "plan.png")                     # weights, LR, seq len vs step

Everything here is computed from the schedule's pure functions; nothing reads data.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np

from data import files
from data.errors import ConfigError
from data.formatting import human
from data.manifest import build_manifest
from data.schedules import LRSchedule, Schedule, tokens_per_phase, tokens_per_source


def implied_epochs(schedule: Schedule, available_tokens: dict[str, int]) -> dict[str, float]:
    """Tokens drawn over available tokens, per source; ``inf`` when a drawn source has no tokens.

    Raises:
        ConfigError: when ``available_tokens`` lacks one of the schedule's sources.
    """
    missing = [s for s in schedule.sources if s not in available_tokens]
    if missing:
        raise ConfigError(f"schedule.mixture: sources {missing} have no token count in the corpus "
                          f"(it counts {sorted(available_tokens)})")
    return {source: (drawn / available_tokens[source] if available_tokens[source] > 0
                     else float("inf") if drawn > 0 else 0.0)
            for source, drawn in tokens_per_source(schedule).items()}


def check_epochs(schedule: Schedule, available_tokens: dict[str, int], max_epochs: float = 4.0,
                 error: bool = False) -> None:
    """Warns (one ``UserWarning`` per source) or raises when a source repeats more than ``max_epochs``.

    Args:
        schedule: the run's schedule.
        available_tokens: tokens per source in the corpus (the manifest's ``token_count`` sums).
        max_epochs: the limit, ``data.max_epochs`` in the config.
        error: raise one ConfigError listing every offending source instead of warning.
    """
    drawn = tokens_per_source(schedule)
    lines = [
        f"source {source!r} would be repeated {epochs:.2f} epochs ({human(drawn[source])} tokens drawn of "
        f"{human(available_tokens[source])} available), above data.max_epochs = {max_epochs:g}: lower its "
        "weight in schedule.mixture, lower schedule.train_tokens or raise data.max_epochs"
        for source, epochs in implied_epochs(schedule, available_tokens).items() if epochs > max_epochs
    ]
    if error and lines:
        raise ConfigError("\n".join(lines))
    for line in lines:
        warnings.warn(line, stacklevel=2)


def plan_table(schedule: Schedule, available_tokens: dict[str, int], lr: LRSchedule | None = None) -> str:
    """A fixed-width text table of the run's data plan.

    One row per source: tokens available, tokens drawn, implied epochs and its share of each
    phase's tokens (ramps included); then the step and token totals, the anneal start, the phase
    boundaries, the end of the sequence-length warmup and (given) the LR schedule.
    """
    drawn = tokens_per_source(schedule)
    epochs = implied_epochs(schedule, available_tokens)
    phases = tokens_per_phase(schedule)
    header = ["source", "available", "drawn", "epochs"] + [f"{name} share" for name in phases]
    rows = [header]
    for source in schedule.sources:
        shares = [f"{100 * t[source] / sum(t.values()):.1f}%" for t in phases.values()]
        rows.append([source, human(available_tokens[source]), human(drawn[source]),
                     f"{epochs[source]:.2f}"] + shares)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    config, seq = schedule.config, schedule.config.seq_len
    boundaries = ", ".join(f"{name} @ {step:,}" for name, step in schedule.phase_boundaries)
    facts = [
        ("total steps", f"{schedule.total_steps:,} x {config.global_batch_size} sequences"),
        ("total tokens", f"{human(schedule.total_tokens)} (budget {human(config.train_tokens)})"),
        ("anneal start", f"step {schedule.anneal_step:,} (schedule.anneal_start = {config.anneal_start:g})"),
        ("phase boundaries", boundaries + (f" (ramps of {config.mixture.ramp_steps} steps)"
                                           if config.mixture.ramp_steps else "")),
        ("seq-len warmup end", f"step {seq.warmup_steps:,} ({seq.start} -> {seq.end})" if seq.warmup_steps
         else f"none ({seq.end})"),
    ]
    if lr is not None:
        c = lr.config
        facts.append(("lr", f"{c.shape}: peak {c.peak:.2e} after {c.warmup_steps:,} steps, decay from step "
                            f"{lr.decay_start:,}, {c.min:.2e} at the end"))
    return "\n".join(lines + [""] + [f"{name:<20}{value}" for name, value in facts]) + "\n"


def plot_schedule(schedule: Schedule, lr: LRSchedule, out_path: str | os.PathLike) -> None:
    """Writes one PNG: mixture weights, learning rate and sequence length against the step.

    The three panels share the step axis; dashed vertical lines mark the phase boundaries and the
    LR decay start. The file is written to a temporary name in the same folder, then renamed, so
    a reader never sees half a PNG.
    """
    from matplotlib.figure import Figure  # imported here: the data stream imports this module too

    from data.plotting import source_colors

    steps = _plot_steps(schedule, lr.decay_start)
    weights = np.array([[schedule.mixture_weights(s)[src] for src in schedule.sources] for s in steps])
    fig = Figure(figsize=(10, 8), layout="constrained")
    ax_mix, ax_lr, ax_seq = fig.subplots(3, 1, sharex=True)
    colors = source_colors(schedule.sources)  # each source's colour in every picture (data/plotting.py)
    ax_mix.stackplot(steps, weights.T, labels=schedule.sources, colors=[colors[s] for s in schedule.sources],
                     alpha=0.85)
    ax_mix.set(ylabel="mixture weight", ylim=(0, 1), xlim=(0, schedule.total_steps - 1))
    ax_mix.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax_lr.plot(steps, [lr(s) for s in steps])
    ax_lr.set_title(f"model.lr.shape: {lr.config.shape}", fontsize="small", loc="right")
    ax_lr.set(ylabel="learning rate")
    ax_seq.plot(steps, [schedule.max_seq_len(s) for s in steps], drawstyle="steps-post")
    ax_seq.set(ylabel="max sequence length", xlabel="optimizer step")

    marks: dict[int, list[str]] = {}
    for name, first in schedule.phase_boundaries[1:]:
        marks.setdefault(first, []).append(name)
    if lr.decay_start < schedule.total_steps:
        marks.setdefault(lr.decay_start, []).append("LR decay")
    for step, labels in marks.items():
        for ax in (ax_mix, ax_lr, ax_seq):
            ax.axvline(step, color="black", linestyle="--", linewidth=0.8)
        ax_mix.annotate(" / ".join(labels), (step, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize="small")
    fig.suptitle(f"{schedule.total_steps:,} steps, {human(schedule.total_tokens)} tokens")

    out_path = Path(out_path)
    with files.atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def _plot_steps(schedule: Schedule, decay_start: int, n: int = 1000) -> list[int]:
    """About ``n`` evenly spaced steps plus every step of the warmups and ramps and each boundary's neighbours."""
    last, ramp = schedule.total_steps - 1, schedule.config.mixture.ramp_steps
    steps = set(np.linspace(0, last, n).round().astype(int).tolist())
    steps |= set(range(schedule.config.seq_len.warmup_steps + 1))  # every seq-len jump
    for _, first in schedule.phase_boundaries:
        steps |= set(range(first - 1, first + ramp + 1))
    steps |= {decay_start - 1, decay_start}
    return sorted(s for s in steps if 0 <= s <= last)


def effective_streams(manifest, cfg, num_consumers: int) -> dict[str, dict[str, float]]:
    """What each source's stream will really hold per consumer, given the epoch barrier (data/stream.py).

    A consumer never holds two source-epochs at once, so its open chunks are capped by its chunks per
    epoch and its buffer by its documents per epoch (means over consumers: slices differ by a chunk).
    With more consumers than chunks a consumer gets one chunk every C / N epochs, and about C / N
    source-epochs are read at once across the job.
    """
    out = {}
    for name, info in manifest.sources.items():
        n_chunks, docs = len(info.chunks), info.docs
        chunks_per = n_chunks / num_consumers  # below 1: one chunk in some epochs, none in the others
        docs_per = max(1.0, chunks_per) * docs / max(1, n_chunks)
        out[name] = {
            "docs": docs, "chunks": n_chunks, "chunks_per_consumer_epoch": chunks_per,
            "open": min(cfg.open_shards, max(1, math.ceil(chunks_per))), "docs_per_consumer_epoch": docs_per,
            "buffer": min(cfg.buffer_size, max(1, round(docs_per))),
            "epochs_in_flight": max(1.0, num_consumers / max(1, n_chunks)),
        }
    return out


def stream_table(manifest, cfg, num_consumers: int) -> str:
    """:func:`effective_streams` as a text table: the run's effective open chunks and buffer per source."""
    eff = effective_streams(manifest, cfg, num_consumers)
    header = ["source", "docs", "chunks", "chunks/consumer-epoch", f"open (k={cfg.open_shards})",
              "docs/consumer-epoch", f"buffer (B={cfg.buffer_size})", "epochs in flight"]
    rows = [header] + [
        [name, f"{e['docs']:,}", f"{e['chunks']:,}", f"{e['chunks_per_consumer_epoch']:.2f}", str(e["open"]),
         f"{e['docs_per_consumer_epoch']:,.1f}", f"{e['buffer']:,}" + ("*" if e["buffer"] < cfg.buffer_size else ""),
         f"{e['epochs_in_flight']:.1f}"]
        for name, e in eff.items()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"{num_consumers} consumers (ranks x workers); * capped by what one source-epoch gives a consumer "
                 "(docs/consumer-epoch counts the epochs that give it a chunk)")
    return "\n".join(lines) + "\n"


def parse_tokens(text: str) -> dict[str, int]:
    """``web=1e9,code=2.5e8`` -> {"web": 1000000000, "code": 250000000}."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            n = float(value)
        except ValueError:
            raise ConfigError(f"--tokens: '{item}' is not source=count (e.g. web=1e9,code=2e8)") from None
        if not n >= 0:
            raise ConfigError(f"--tokens: '{item}': the count must be >= 0")
        out[name.strip()] = int(n)
    return out


def available_tokens(cfg, tokens_flag: dict[str, int] | None) -> tuple[dict[str, int], str]:
    """Tokens per source and where they came from: --tokens, the manifest, or data.expected_tokens."""
    names = list(cfg.sources)
    if tokens_flag is not None:
        return _flag_tokens(names, tokens_flag, cfg.expected_tokens or {}), "--tokens"
    absent = [n for n in names if not cfg.sources[n].files()]
    if not absent:
        manifest = build_manifest(cfg)  # validates every file; a bad one is an error, not a fallback
        skipped = f", {len(manifest.skipped)} bad file(s) skipped" if manifest.skipped else ""
        return ({n: manifest.sources[n].stream_tokens for n in names},
                f"corpus manifest (token_count + one EOT per training document{skipped})")
    return _expected_tokens(cfg, names, absent)


def _expected_tokens(cfg, names: list[str], absent: list[str]) -> tuple[dict[str, int], str]:
    """data.expected_tokens, when the corpus files of ``absent`` sources are not on this machine."""
    if cfg.expected_tokens is None:
        raise ConfigError(
            f"no corpus files for source(s) {absent} (globs: "
            + "; ".join(f"{n}: {cfg.sources[n].paths}" for n in absent)
            + "); point --corpus at a corpus, or give the counts with --tokens web=1e9,... or data.expected_tokens")
    missing = [n for n in names if n not in cfg.expected_tokens]
    if missing:
        raise ConfigError(f"data.expected_tokens: no count for source(s) {missing}; give one per source")
    return ({n: int(cfg.expected_tokens[n]) for n in names},
            f"data.expected_tokens (published counts; no corpus files for {', '.join(absent)} here)")


def _flag_tokens(names: list[str], tokens_flag: dict[str, int], fallback: dict[str, int]) -> dict[str, int]:
    """--tokens per source, data.expected_tokens for a source it leaves out."""
    unknown = sorted(set(tokens_flag) - set(names))
    if unknown:
        raise ConfigError(f"--tokens: unknown source(s) {unknown}; the config has {names}")
    missing = [n for n in names if n not in tokens_flag and n not in fallback]
    if missing:
        raise ConfigError(f"--tokens: no count for source(s) {missing} (and none in data.expected_tokens)")
    return {n: int(tokens_flag.get(n, fallback.get(n, 0))) for n in names}
