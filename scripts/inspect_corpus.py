"""What a downloaded corpus holds, and which mixture source each value feeds, before any compute.

    python scripts/inspect_corpus.py $DOLMA3_DIR --config configs/pretrain_350m_20b.yaml

Prints the distinct ``source`` and ``category`` values with rows, tokens (``token_count``) and share,
the mixture source each value goes to under the config's ``filter:`` blocks (``-`` for none), the
tokens per mixture source, and the values no filter takes (never trained on) or several take
(trained twice). Reads only the small columns, never ``text``. Library: data/corpus/inspect.py.
Exit status 2 with ``error: ...`` when the folder holds no parquet file or the config is unreadable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from data.corpus.inspect import filters_of, format_report, inspect_corpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="corpus folder (searched recursively for parquet files)")
    p.add_argument("--config", default=None, help="run YAML whose data.sources filters to apply")
    p.add_argument("--pattern", default="**/*.parquet", help="glob under DIR (default **/*.parquet)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    filters = None
    if args.config:
        try:
            raw = yaml.safe_load(Path(args.config).read_text()) or {}
            sources = (raw.get("data") or {}).get("sources")
        except (OSError, yaml.YAMLError) as e:
            print(f"error: --config {args.config}: {e}", file=sys.stderr)
            return 2
        if not isinstance(sources, dict) or not sources:
            print(f"error: --config {args.config}: no data.sources mapping to take the filters from", file=sys.stderr)
            return 2
        filters = filters_of(sources)
    try:
        summary = inspect_corpus(args.dir, args.pattern)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(summary, filters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
