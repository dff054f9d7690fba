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

import argparse
import sys
import warnings
from pathlib import Path

from data.config import DataConfig, corpus_sources, load_data_config
from data.errors import ConfigError


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


def available_tokens(cfg: DataConfig, tokens_flag: dict[str, int] | None) -> tuple[dict[str, int], str]:
    """Tokens per source and where they came from: --tokens, the manifest, or data.expected_tokens."""
    names = list(cfg.sources)
    if tokens_flag is not None:
        unknown = sorted(set(tokens_flag) - set(names))
        if unknown:
            raise ConfigError(f"--tokens: unknown source(s) {unknown}; the config has {names}")
        fallback = cfg.expected_tokens or {}
        missing = [n for n in names if n not in tokens_flag and n not in fallback]
        if missing:
            raise ConfigError(f"--tokens: no count for source(s) {missing} (and none in data.expected_tokens)")
        return {n: int(tokens_flag.get(n, fallback.get(n, 0))) for n in names}, "--tokens"

    absent = [n for n in names if not cfg.sources[n].files()]
    if not absent:
        from data.manifest import build_manifest

        manifest = build_manifest(cfg)  # validates every file; a bad one is an error, not a fallback
        skipped = f", {len(manifest.skipped)} bad file(s) skipped" if manifest.skipped else ""
        return ({n: manifest.sources[n].stream_tokens for n in names},
                f"corpus manifest (token_count + one EOT per training document{skipped})")
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


def memory_plan(config_path: str, micro_batch: int, seq_len: int, gpu_gib: float) -> str:
    """The estimated peak memory per GPU (train/memory.py) of the config's model at its micro-batch and
    longest sequence, for each loss path with and without activation checkpointing; the start-up check
    refuses what does not fit the GPU it runs on."""
    import inspect

    import yaml

    from train.memory import FIT_FRACTION, GB, estimate_peak_memory
    from train.model import ModelConfig, load_model_config
    from train.module import PretrainModule

    model = ((yaml.safe_load(Path(config_path).read_text()) or {}).get("model") or {}).get("model")
    if model is None:
        model = inspect.signature(PretrainModule.__init__).parameters["model"].default
    cfg = ModelConfig(**model) if isinstance(model, dict) else load_model_config(model)
    budget = FIT_FRACTION * gpu_gib * 2**30
    lines = [f"memory per GPU (DDP, bf16-mixed; model {model if isinstance(model, str) else 'inline'}, "
             f"data.batch_size {micro_batch} x {seq_len} tokens; fits = under {FIT_FRACTION:.0%} of "
             f"{gpu_gib:g} GiB, --gpu-memory-gib):"]
    for loss in ("chunked", "plain"):
        for ckpt in (False, True):
            total = estimate_peak_memory(cfg, micro_batch, seq_len, loss=loss, activation_checkpointing=ckpt)["total"]
            chosen = loss == cfg.loss_impl and ckpt == cfg.activation_checkpointing
            lines.append(f"  model.loss_impl {loss:<8} activation_checkpointing {str(ckpt).lower():<5} "
                         f"{total / GB:7.1f} GB  {'fits' if total <= budget else 'DOES NOT FIT'}"
                         + ("   <- this config" if chosen else ""))
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from data.plan import check_epochs, plan_table, plot_schedule
    from data.schedules import build_schedule

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
        print(f"error: {e}", file=sys.stderr)
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
        print("\neffective streams per consumer (the epoch barrier caps what a small source can hold):")
        print(stream_table(build_manifest(cfg), cfg, consumers))
    print("\n" + memory_plan(args.config, cfg.batch_size, schedule.config.seq_len.end, args.gpu_memory_gib))
    plot_schedule(schedule, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
