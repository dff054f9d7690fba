"""What a downloaded corpus holds, and which mixture source each value feeds, before any compute.

    python scripts/inspect_corpus.py $DOLMA3_DIR --config configs/pretrain_350m_20b.yaml

Prints the distinct ``source`` and ``category`` values with rows, tokens (``token_count``) and share,
and, with ``--config``, the mixture source each value goes to under the config's ``filter:`` blocks
(``-`` for none) and the start-up mapping report (data/mapping.py: per source and pattern the values
matched; the unclaimed values; a pattern matching nothing, unclaimed values above ``data.unclaimed`` or
a value claimed twice are marked ``error:`` as ``train fit`` would refuse them). Then a ``sources:``
block for the values found, ready to paste, and duplicate-text counts on a sample of rows
(``--sample-rows``; the Dolma 3 mix upsamples documents, so some repeat). Reads only the small columns,
except the sampled texts. Library: data/corpus/inspect.py.

Exit status 0; 1 when the config's mapping has errors (``train fit`` would refuse it); 2 with
``error: ...`` when the folder holds no parquet file, is an incomplete global-shuffle output, or the
config is unreadable.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
from pathlib import Path

import yaml

from data.corpus.inspect import (
    duplicate_counts,
    filters_of,
    format_duplicates,
    format_report,
    inspect_corpus,
    propose_sources,
)
from data.errors import ConfigError, one_line_errors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="corpus folder (searched recursively for parquet files)")
    p.add_argument("--config", default=None, help="run YAML whose data.sources filters to apply")
    p.add_argument("--pattern", default="**/*.parquet", help="glob under DIR (default **/*.parquet)")
    p.add_argument("--sample-rows", type=int, default=20_000,
                   help="rows whose texts are checked for duplicates (default 20,000; 0: skip)")
    p.add_argument("--paths", default="$DOLMA3_DIR/**/*.parquet", help="the glob the proposed sources block reads")
    return p


def _config_filters(path: str) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        sources = (raw.get("data") or {}).get("sources")
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    if not isinstance(sources, dict) or not sources:
        raise ConfigError(f"--config {path}: no data.sources mapping to take the filters from")
    return filters_of(sources)


def _mapping(config: str, summary):
    """The start-up mapping report of the config's filters over every file of the folder."""
    from data.config import load_data_config
    from data.mapping import build_mapping

    cfg = load_data_config(config)
    files = {name: list(summary.paths) for name in cfg.sources}
    return build_mapping(cfg, files, summary.per_file)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from data.shuffled import shuffle_problems

    filters = _config_filters(args.config) if args.config else None
    try:
        summary = inspect_corpus(args.dir, args.pattern)
    except FileNotFoundError as e:  # no parquet file in the folder
        raise ConfigError(str(e)) from None
    incomplete = shuffle_problems(summary.paths)
    if incomplete:
        raise ConfigError("\n".join(incomplete))
    mapping = _mapping(args.config, summary) if args.config else None
    print(format_report(summary, filters))
    if mapping is not None:
        print("\n" + mapping.text())
    if summary.values["source"]:
        print("\n" + propose_sources(summary, args.paths))
    if args.sample_rows > 0:
        print("\n" + format_duplicates(duplicate_counts(summary.paths, args.sample_rows)))
    return 1 if mapping is not None and mapping.errors else 0


if __name__ == "__main__":
    sys.exit(main())
