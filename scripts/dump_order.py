"""Dump the document order a run would train on, before spending any compute.

Runs the real data path (manifest, two-level stream, mixer, packer) for R ranks x W workers in one
process, no model, and writes one JSON line per (step, rank) -- the format is in data/order.py.

    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --world-size 2 --num-workers 2 --out order.jsonl
    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --save-cursor-at 40 --out a.jsonl
    python scripts/dump_order.py --config configs/demo.yaml --steps 100 --resume-from a.jsonl.cursor.json --out b.jsonl
    # a.jsonl + b.jsonl == the uninterrupted dump

The configuration is resolved as ``python -m train fit`` resolves its data section, without importing torch
or Lightning (data/config.py's resolve_data_config; a run's config.yaml is accepted): stacked
``--config`` files, ``PL_FIT__DATA__<KEY>`` environment variables and ``--data.<key>`` overrides
(``--data.seed 7``, ``--data.batch_size 2``, ``--data.schedule.seq_len.end 512``). ``--corpus DIR`` reads
DIR/<source>/*.parquet instead of the config's globs. The older spellings map onto those keys (each
flag's help below names its key): ``--seed``, ``--batch-size``, ``--buffer-size``, ``--open-shards``,
``--selector``, ``--weights`` (a fixed mixture, ``web=0.6,...`` or JSON) and ``--seq-len L`` (one length
throughout). The default ``--steps`` is the total of the schedule that results.
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
from typing import Any

from data import files
from data.config import (
    ToolParser,
    check_weights,
    corpus_sources,
    resolve_sections,
    split_tool_args,
)
from data.errors import ConfigError, one_line_errors
from data.manifest import build_manifest
from data.plan import stream_table
from data.simulate import OrderSimulator, dumps

OLD_FLAGS = {"seed": "data.seed", "batch_size": "data.batch_size", "buffer_size": "data.buffer_size",
             "open_shards": "data.open_shards", "selector": "data.selector"}
"""This script's older flags (``--batch-size``) and the configuration key each sets."""


def parse_weights(text: str) -> dict[str, float]:
    """``web=0.62,code=0.38`` or the JSON object ``{"web": 0.62, "code": 0.38}``."""
    if text.lstrip().startswith("{"):
        try:
            weights = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--weights: not a JSON object of source weights: {e}") from None
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights.values()):
            raise ConfigError(f"--weights: {text} must map each source to a number")
        return {str(name): float(w) for name, w in weights.items()}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--weights: '{item}' is not source=weight (e.g. web=0.62,code=0.38)") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog="Also every option of `python -m train fit` "
                                "(--config, --data.*, ...).")
    p.add_argument("--steps", type=int, default=None, help="steps to dump (default: the schedule's total steps)")
    p.add_argument("--world-size", type=int, default=1, help="ranks R")
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers W per rank (default: config)")
    p.add_argument("--out", required=True, help="output .jsonl file ('-' for stdout)")
    p.add_argument("--save-cursor-at", type=int, default=None, metavar="S",
                   help="stop after step S and write the cursor to OUT.cursor.json")
    p.add_argument("--resume-from", default=None, metavar="CURSOR_FILE", help="continue from a saved cursor")
    p.add_argument("--corpus", default=None, help="use DIR/<source>/*.parquet instead of the config's globs")
    p.add_argument("--weights", default=None, help="fixed mixture, e.g. web=0.62,code=0.18,books=0.12,curated=0.08 "
                   "or JSON (sets data.schedule.mixture.weights, replacing the configured mixture)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help="one sequence length throughout (sets data.schedule.seq_len.start and .end to L, "
                        "warmup_steps 0, multiple 1)")
    for flag, key in OLD_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), default=None, metavar=key.split(".")[1].upper(),
                       help=f"= --{key}")
    return p


def resolve(args: argparse.Namespace, rest: list[str]) -> Any:
    """The data config (``.data``) and the LR schedule (``.model.lr``, for the lines' ``lr``) of ``--config ...
    --data.* ...`` (``rest``) with the older flags mapped onto their keys
    (after the user's, so that they win as they did); ``--weights`` checked against the configured sources
    first, so an error names the flag at fault."""
    mapped = [a for flag, key in OLD_FLAGS.items() if getattr(args, flag) is not None
              for a in (f"--{key}", str(getattr(args, flag)))]
    written = resolve_sections(rest)
    if args.weights is not None:
        weights = parse_weights(args.weights)
        check_weights(weights, list(written.data.sources), "--weights")
        fixed = {"weights": weights, "phases": [], "ramp_steps": 0, "fixed_equivalent_of": None}
        mapped += ["--data.schedule.mixture", json.dumps(fixed)]  # every key: the configured ones are replaced
    if args.seq_len is not None:
        one_length = {"start": args.seq_len, "end": args.seq_len, "warmup_steps": 0, "multiple": 1}
        mapped += ["--data.schedule.seq_len", json.dumps(one_length)]
    return resolve_sections(rest + mapped) if mapped else written


def load_cursor(sim: OrderSimulator, path: str) -> None:
    """Continue ``sim`` from the cursor file ``path`` (written with --save-cursor-at); ConfigError naming it."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume-from {path}: unreadable cursor file: {e}") from None
    try:
        sim.load_state_dict(state)
    except ConfigError as e:  # a damaged or edited cursor: say which file
        raise ConfigError(f"--resume-from {path}: {e}") from None
    except Exception as e:  # valid JSON, but not a cursor (wrong keys, types, or packed buffers)
        raise ConfigError(f"--resume-from {path}: not a cursor written by dump_order "
                          f"({type(e).__name__}: {e})") from None


def write_lines(sim: OrderSimulator, stop: int, out_path: str) -> int:
    """The order lines up to step ``stop`` into ``out_path`` (atomically; '-': stdout); how many."""
    lines = 0
    with contextlib.ExitStack() as stack:
        out = sys.stdout if out_path == "-" else open(stack.enter_context(files.atomic_path(out_path)), "w")
        for line in sim.order_lines(stop):
            out.write(dumps(line) + "\n")
            lines += 1
        if out is not sys.stdout:
            out.close()
    return lines


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    own, rest = split_tool_args(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)  # -h prints the help and exits
    sections = resolve(args, rest)
    cfg = sections.data
    if args.corpus:
        cfg.sources = corpus_sources(args.corpus, list(cfg.sources))
    manifest = build_manifest(cfg)
    workers = cfg.num_workers if args.num_workers is None else args.num_workers
    sim = OrderSimulator(manifest, cfg, args.world_size, workers, lr=sections.model.lr)
    if args.resume_from:
        load_cursor(sim, args.resume_from)
    steps = sim.steps.total_steps if args.steps is None else args.steps
    stop = steps if args.save_cursor_at is None else min(steps, args.save_cursor_at + 1)

    print("effective streams (per consumer):\n" + stream_table(manifest, cfg, args.world_size * sim.workers),
          file=sys.stderr)
    t0 = time.perf_counter()
    lines = write_lines(sim, stop, args.out)
    if args.save_cursor_at is not None:
        cursor = Path(args.out + ".cursor.json")
        files.write_json(cursor, sim.state_dict(), indent=None)
        print(f"cursor after step {sim.step - 1}: {cursor} ({cursor.stat().st_size / 1e3:.1f} KB)", file=sys.stderr)
    print(f"wrote {lines} lines (steps {sim.step - (lines // max(1, args.world_size))}..{sim.step - 1}) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
