"""Dump the document order a run would train on, before spending any compute.

Runs the real data path (manifest, two-level stream, mixer, packer) for R ranks x W workers in one
process, no model, and writes one JSON line per (step, rank) -- the format is in data/order.py.

    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --world-size 2 --num-workers 2 --out order.jsonl
    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --save-cursor-at 40 --out a.jsonl
    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --resume-from a.jsonl.cursor.json --out b.jsonl
    # a.jsonl + b.jsonl == the uninterrupted dump

Flags override the config: --corpus DIR (DIR/<source>/*.parquet), --seed, --weights web=0.6,...,
--batch-size, --seq-len, --buffer-size, --open-shards, --selector.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from data import files
from data.config import check_weights, corpus_sources, load_data_config
from data.errors import ConfigError, error_lines, one_line_errors
from data.manifest import build_manifest
from data.plan import stream_table
from data.simulate import OrderSimulator, dumps


def parse_weights(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--weights: '{item}' is not source=weight (e.g. web=0.62,code=0.38)") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config YAML (its data: section is used)")
    p.add_argument("--steps", type=int, default=None, help="steps to dump (default: the schedule's total steps)")
    p.add_argument("--world-size", type=int, default=1, help="ranks R")
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers W per rank (default: config)")
    p.add_argument("--out", required=True, help="output .jsonl file ('-' for stdout)")
    p.add_argument("--save-cursor-at", type=int, default=None, metavar="S",
                   help="stop after step S and write the cursor to OUT.cursor.json")
    p.add_argument("--resume-from", default=None, metavar="CURSOR_FILE", help="continue from a saved cursor")
    p.add_argument("--corpus", default=None, help="use DIR/<source>/*.parquet instead of the config's globs")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--weights", default=None, help="fixed mixture, e.g. web=0.62,code=0.18,books=0.12,curated=0.08")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--buffer-size", type=int, default=None)
    p.add_argument("--open-shards", type=int, default=None)
    p.add_argument("--selector", choices=["deficit", "random"], default=None)
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict = {}
    for flag, key in [("seed", "seed"), ("batch_size", "batch_size"), ("seq_len", "seq_len"),
                      ("buffer_size", "buffer_size"), ("open_shards", "open_shards"), ("selector", "selector")]:
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    try:
        # Flag values are checked against the config as written, so an error names the flag at fault
        # (not data.weights of a config file the user did not edit).
        written = load_data_config(args.config)
        if args.weights is not None:
            weights = parse_weights(args.weights)
            check_weights(weights, list(written.sources), "--weights")
            overrides["weights"], overrides["schedule"] = weights, None
        elif args.seq_len is not None and written.schedule is not None:
            raise ConfigError("--seq-len replaces the schedule's sequence-length warmup: also give --weights "
                              f"for a fixed mixture of {list(written.sources)}")
        cfg = load_data_config(args.config, overrides)
        if args.corpus:
            cfg.sources = corpus_sources(args.corpus, list(cfg.sources))
        manifest = build_manifest(cfg)
        workers = cfg.num_workers if args.num_workers is None else args.num_workers
        sim = OrderSimulator(manifest, cfg, args.world_size, workers)
        steps = args.steps
        if steps is None:
            steps = sim.steps.total_steps
            if steps is None:
                raise ConfigError("--steps is required with a fixed mixture (no schedule gives the total)")
        if args.resume_from:
            try:
                state = json.loads(Path(args.resume_from).read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"--resume-from {args.resume_from}: unreadable cursor file: {e}") from None
            try:
                sim.load_state_dict(state)
            except ConfigError as e:  # a damaged or edited cursor: say which file
                raise ConfigError(f"--resume-from {args.resume_from}: {e}") from None
            except Exception as e:  # valid JSON, but not a cursor (wrong keys, types, or packed buffers)
                raise ConfigError(f"--resume-from {args.resume_from}: not a cursor written by dump_order "
                                  f"({type(e).__name__}: {e})") from None
        stop = steps if args.save_cursor_at is None else min(steps, args.save_cursor_at + 1)
    except ConfigError as e:
        print(error_lines(e), file=sys.stderr)
        return 2

    print("effective streams (per consumer):\n" + stream_table(manifest, cfg, args.world_size * sim.workers),
          file=sys.stderr)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.out == "-" else open(stack.enter_context(files.atomic_path(args.out)), "w")
        lines = 0
        for line in sim.order_lines(stop):
            out.write(dumps(line) + "\n")
            lines += 1
        if out is not sys.stdout:
            out.close()
    if args.save_cursor_at is not None:
        cursor = Path(args.out + ".cursor.json")
        files.write_json(cursor, sim.state_dict(), indent=None)
        print(f"cursor after step {sim.step - 1}: {cursor} ({cursor.stat().st_size / 1e3:.1f} KB)", file=sys.stderr)
    print(f"wrote {lines} lines (steps {sim.step - (lines // max(1, args.world_size))}..{sim.step - 1}) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
