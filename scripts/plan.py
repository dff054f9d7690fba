"""Print a run's data plan and draw its schedules, before spending any compute.

Reads the ``data:`` section of a run config, builds the schedule, takes the tokens available per
source from the corpus manifest (metadata only) -- or, when the corpus is not on this machine, from
the config's ``data.expected_tokens`` (the published counts) or ``--tokens`` -- and prints, per
source, the tokens available and drawn, the implied epochs and the share of each phase; then the
step and token totals and phase boundaries. The PNG shows mixture weights, learning rate and
sequence length against the step, phase boundaries marked.

    python scripts/plan.py --config configs/pretrain_350m_20b.yaml        # PNG in runs/plan/
    python scripts/plan.py --config configs/pretrain_350m_20b.yaml --config configs/presets/64gpu.yaml
    python scripts/plan.py --config configs/demo.yaml --corpus demo_corpus --out demo_plan.png
    python scripts/plan.py --config configs/pretrain_350m_20b.yaml \\
        --tokens web=2e11,code=2e10,books=4e10,curated=1e10 --out plan.png

The configuration is resolved as ``python -m train fit`` resolves it (train/config.py): stacked
``--config`` files and any ``--data.*`` / ``--model.*`` / ``--trainer.*`` override, e.g.
``--data.schedule.train_tokens 2e9`` or ``--model.model.n_layers 24``. The ranks default to the
config's ``trainer.devices x trainer.num_nodes``.

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
from typing import Any, NamedTuple

from data.config import ToolParser, corpus_sources, split_tool_args
from data.errors import ConfigError, error_lines, one_line_errors
from data.manifest import build_manifest
from data.plan import available_tokens, check_epochs, parse_tokens, plan_table, plot_schedule, stream_table
from data.schedules import LRConfig, build_schedule


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, epilog="Also every option of `python -m train fit` "
                                "(--config, --data.*, --model.*, --trainer.*, --run.*).")
    p.add_argument("--out", default=None,
                   help="PNG to write (mixture weights, LR, seq len vs step); default runs/plan/<config names>.png")
    p.add_argument("--corpus", default=None, help="use DIR/<source>/*.parquet instead of the config's globs")
    p.add_argument("--tokens", default=None, metavar="SRC=N,...",
                   help="available tokens per source, e.g. web=2.28e11,code=2.07e10 (instead of the corpus)")
    p.add_argument("--max-epochs", type=float, default=None,
                   help="warn above this many epochs of a source (default: data.max_epochs)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks, for the effective buffer and open chunks per source (with data.num_workers); "
                        "default: trainer.devices x trainer.num_nodes of the config (1 if not numbers)")
    p.add_argument("--gpu-memory-gib", type=float, default=140.0,
                   help="GPU memory for the per-GPU memory plan (default 140: an H200; 80 for an H100)")
    p.add_argument("--strict", action="store_true",
                   help="an epoch count above the limit is an error (as data.max_epochs_error: true)")
    return p


def config_ranks(trainer) -> int:
    """trainer.devices x trainer.num_nodes when both are numbers (``auto`` and device lists count 1)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    return devices * nodes if isinstance(devices, int) and devices > 0 and isinstance(nodes, int) else 1


class Plan(NamedTuple):
    """What the plan prints and draws, resolved from the config before anything is printed: the config
    files (for the header), the run's DataConfig (``--corpus`` applied) and ModelConfig, the built schedule
    and LR schedule (``model.lr``), where the available tokens came from, the plan table, the epoch limit and
    its warnings, the PNG."""

    name: str
    cfg: Any
    model: Any
    schedule: Any
    lr: Any
    origin: str
    table: str
    max_epochs: float
    caught: list
    out: Path


def make_plan(args: argparse.Namespace, resolved) -> Plan:
    """The schedule, available tokens, plan table and epoch warnings of a resolved config; ConfigError
    for an invalid config, corpus or ``--out``."""
    from train.config import config_sources, data_config, model_config

    cfg, model = data_config(resolved), model_config(resolved)
    if args.corpus:
        cfg.sources = corpus_sources(args.corpus, list(cfg.sources))
    schedule = build_schedule(cfg.schedule, sources=list(cfg.sources))
    lr = LRConfig(**resolved.model.lr.as_dict()).build(schedule.total_steps, schedule.anneal_step)
    tokens, origin = available_tokens(cfg, None if args.tokens is None else parse_tokens(args.tokens))
    table = plan_table(schedule, tokens, lr)
    max_epochs = cfg.max_epochs if args.max_epochs is None else args.max_epochs
    caught = epoch_warnings(schedule, tokens, max_epochs, strict=args.strict or cfg.max_epochs_error)
    return Plan(name=config_sources(resolved), cfg=cfg, model=model, schedule=schedule, lr=lr, origin=origin,
                table=table, max_epochs=max_epochs, caught=caught, out=out_path(args, resolved))


def epoch_warnings(schedule, tokens: dict[str, float], max_epochs: float, strict: bool) -> list:
    """The implied-epoch warnings (data/plan.py check_epochs), caught to print after the table; with
    ``strict`` an epoch count above the limit raises ConfigError instead."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_epochs(schedule, tokens, max_epochs=max_epochs, error=strict)
    return caught


def out_path(args: argparse.Namespace, resolved) -> Path:
    """``--out``, or runs/plan/<config names>.png (its folder made); a missing ``--out`` folder is refused."""
    stems = "+".join(Path(str(getattr(c, "relative", c))).stem for c in resolved.get("config") or []) or "plan"
    out = Path(args.out) if args.out else Path("runs/plan") / f"{stems}.png"
    if args.out is None:
        out.parent.mkdir(parents=True, exist_ok=True)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    return out


def print_plan(plan: Plan, args: argparse.Namespace, resolved) -> None:
    """The header, the plan table, the epoch verdict, the streams per consumer and the memory plan."""
    from train.config import model_source
    from train.memory import memory_plan
    from train.optim import OptimConfig

    print(f"plan for {plan.name}; available tokens: {plan.origin}\n")
    print(plan.table)
    if plan.caught:
        for w in plan.caught:
            print(f"warning: {w.message}")
    else:
        limit = "data.max_epochs" if args.max_epochs is None else "--max-epochs"
        print(f"implied epochs: every source at most {plan.max_epochs:g} ({limit}; no warning)")
    cfg = plan.cfg
    if args.tokens is None and all(cfg.sources[n].files() for n in cfg.sources):
        world_size = config_ranks(resolved.trainer) if args.world_size is None else args.world_size
        print_streams(cfg, world_size * max(1, cfg.num_workers))
    seq = plan.schedule.config.seq_len.end
    optim = resolved.model.optim and OptimConfig(**resolved.model.optim.as_dict())
    print("\n" + memory_plan(plan.model, model_source(resolved), cfg.batch_size, seq, args.gpu_memory_gib, optim))


def print_streams(cfg, consumers: int) -> None:
    """The corpus mapping (filtered sources) and the effective streams per consumer, from the manifest."""
    manifest = build_manifest(cfg)
    if manifest.mapping is not None:
        print("\n" + manifest.mapping.text())
    print("\neffective streams per consumer (the epoch barrier caps what a small source can hold):")
    print(stream_table(manifest, cfg, consumers))


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    from train.config import resolve_config  # the model section too (the memory plan): torch is needed here
    from train.model import ModelConfigError

    parser = build_parser()
    own, rest = split_tool_args(parser, sys.argv[1:] if argv is None else argv)
    if "-h" in own or "--help" in own:
        parser.parse_args(own)  # prints the help and exits
    try:
        resolved = resolve_config(rest)
        args = parser.parse_args(own)
        plan = make_plan(args, resolved)
    except (ConfigError, ModelConfigError) as e:
        print(error_lines(e), file=sys.stderr)
        return 2
    print_plan(plan, args, resolved)
    plot_schedule(plan.schedule, plan.lr, plan.out)
    print(f"wrote {plan.out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
