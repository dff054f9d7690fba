"""Summarise a training run from its CSV log: held-out loss per source at the start and the end,
and one PNG of loss per source against the step.

    python scripts/report_run.py runs/demo [--corpus demo_corpus]

With ``--corpus`` the table also shows the corpus's unigram entropy (the run's data.tokenizer, EOT included):
the loss of a model that learned token frequencies and nothing else.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

from data import files
from data.errors import ConfigError, one_line_errors
from data.tokenizer import Tokenizer, TokenizerConfig
from train.rundir import read_config, read_metrics, series


def unigram_entropy(corpus: Path, tokenizer: Tokenizer) -> float:
    import pyarrow.parquet as pq

    counts = Counter()
    for path in sorted(corpus.glob("*/*.parquet")):
        for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
            counts.update(tokenizer.encode_docs([text])[0].tolist())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def figure(rows, sources: list[str]):
    """Train loss per source (raw points faint, smoothed line on top) and held-out loss per source,
    one colour per source (data/plotting.py: the same colours as diag_loss.png)."""
    from matplotlib.figure import Figure

    from data.plotting import plot_source_losses, source_colors

    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    plot_source_losses(ax1, {s: series(rows, f"train/loss/{s}") for s in sources})
    colors = source_colors(sources)
    for s in sources:
        va = series(rows, f"val/loss/{s}")
        if va:
            ax2.plot([p[0] for p in va], [p[1] for p in va], marker="o", color=colors[s], label=s)
    ax1.set_title("train loss per source (faint: each step; line: moving average)")
    ax2.set(title="held-out loss per source", xlabel="step", ylabel="loss (nats/token)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(rows, sources: list[str], out: Path) -> None:
    with files.atomic_path(out) as tmp:
        figure(rows, sources).savefig(tmp, format="png", dpi=110)


def held_out_table(rows, sources: list[str]) -> list[str]:
    """Held-out loss per source (and over all) at the first and the last evaluation."""
    lines = [f"{'source':<10} {'held-out start':>15} {'held-out end':>13} {'change':>8}"]
    for s in sources + ["all"]:
        va = series(rows, "val/loss" if s == "all" else f"val/loss/{s}")
        if va:
            lines.append(f"{s:<10} {va[0][1]:>15.3f} {va[-1][1]:>13.3f} {va[-1][1] - va[0][1]:>+8.3f}")
    return lines


def entropy_lines(rows, corpus: Path, run_dir: Path) -> list[str]:
    tokenizer = TokenizerConfig(**(read_config(run_dir).get("data") or {}).get("tokenizer") or {}).build()
    h, end = unigram_entropy(corpus, tokenizer), series(rows, "val/loss")
    return [f"unigram entropy of {corpus}: {h:.3f} nats/token"] + (
        [f"final held-out loss is {h - end[-1][1]:.3f} nats below it"] if end else [])


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--corpus", type=Path, default=None,
                   help="corpus dir (DIR/<source>/*.parquet) for the unigram entropy")
    p.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/loss_per_source.png)")
    args = p.parse_args(argv)
    try:
        rows = read_metrics(args.run_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    sources = sorted({k.split("/")[-1] for k in (rows or [{}])[0] if k.startswith(("val/loss/", "train/loss/"))})
    lines = held_out_table(rows, sources) + (entropy_lines(rows, args.corpus, args.run_dir) if args.corpus else [])
    print("\n".join(lines))
    out = args.out or args.run_dir / "loss_per_source.png"
    plot(rows, sources, out)
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
