"""Print a run's data plan and draw its schedules, before spending any compute.

Reads the ``data:`` section of a run config, builds the schedule, takes the tokens available per
source from the corpus manifest (metadata only) -- or, when the corpus is not on this machine, from
the config's ``data.expected_tokens`` (the published counts) or ``--tokens`` -- and prints, per
source, the tokens available and drawn, the implied epochs and the share of each phase; then the
step and token totals and phase boundaries. The PNG shows mixture weights, learning rate and
sequence length against the step, phase boundaries marked.

    python scripts/plan.py --config configs/pretrain_350m_20b.yaml        # PNG in runs/plan/
    python scripts/plan.py --config configs/demo.yaml --corpus demo_corpus --out demo_plan.png
    python scripts/plan.py --config configs/pretrain_350m_20b.yaml \\
        --tokens web=2e11,code=2e10,books=4e10,curated=1e10 --out plan.png

Exit status 2 with ``error: ...`` on stderr for an invalid config or unusable corpus.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
import warnings
from pathlib import Path

from data.config import corpus_sources, load_data_config
from data.errors import ConfigError, error_lines, one_line_errors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config YAML (its data: section is used)")
    p.add_argument("--out", default=None,
                   help="PNG to write (mixture weights, LR, seq len vs step); default runs/plan/<config name>.png")
    p.add_argument("--corpus", default=None, help="use DIR/<source>/*.parquet instead of the config's globs")
    p.add_argument("--tokens", default=None, metavar="SRC=N,...",
                   help="available tokens per source, e.g. web=2.28e11,code=2.07e10 (instead of the corpus)")
    p.add_argument("--max-epochs", type=float, default=None,
                   help="warn above this many epochs of a source (default: data.max_epochs)")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks, for the effective buffer and open chunks per source (with data.num_workers)")
    p.add_argument("--gpu-memory-gib", type=float, default=140.0,
                   help="GPU memory for the per-GPU memory plan (default 140: an H200; 80 for an H100)")
    p.add_argument("--strict", action="store_true",
                   help="an epoch count above the limit is an error (as data.max_epochs_error: true)")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from data.plan import available_tokens, check_epochs, parse_tokens, plan_table, plot_schedule
    from data.schedules import build_schedule
    from train.memory import memory_plan

    try:
        cfg = load_data_config(args.config)
        if args.corpus:
            cfg.sources = corpus_sources(args.corpus, list(cfg.sources))
        if cfg.schedule is None:
            raise ConfigError(f"{args.config}: data.schedule is missing; a plan needs the token budget and "
                              "phases of a schedule (a fixed `weights:` mixture has no steps to plan)")
        schedule = build_schedule(cfg.schedule, sources=list(cfg.sources))
        tokens, origin = available_tokens(cfg, None if args.tokens is None else parse_tokens(args.tokens))
        table = plan_table(schedule, tokens)
        max_epochs = cfg.max_epochs if args.max_epochs is None else args.max_epochs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_epochs(schedule, tokens, max_epochs=max_epochs, error=args.strict or cfg.max_epochs_error)
        out = Path(args.out) if args.out else Path("runs/plan") / f"{Path(args.config).stem}.png"
        if args.out is None:
            out.parent.mkdir(parents=True, exist_ok=True)
        if not out.parent.is_dir():
            raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    except ConfigError as e:
        print(error_lines(e), file=sys.stderr)
        return 2

    print(f"plan for {args.config}; available tokens: {origin}\n")
    print(table)
    if caught:
        for w in caught:
            print(f"warning: {w.message}")
    else:
        limit = "data.max_epochs" if args.max_epochs is None else "--max-epochs"
        print(f"implied epochs: every source at most {max_epochs:g} ({limit}; no warning)")
    if args.tokens is None and all(cfg.sources[n].files() for n in cfg.sources):
        from data.manifest import build_manifest
        from data.plan import stream_table

        consumers = args.world_size * max(1, cfg.num_workers)
        manifest = build_manifest(cfg)
        if manifest.mapping is not None:
            print("\n" + manifest.mapping.text())
        print("\neffective streams per consumer (the epoch barrier caps what a small source can hold):")
        print(stream_table(manifest, cfg, consumers))
    print("\n" + memory_plan(args.config, cfg.batch_size, schedule.config.seq_len.end, args.gpu_memory_gib))
    plot_schedule(schedule, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
