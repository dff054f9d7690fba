"""What a downloaded corpus holds, and which mixture source each value feeds, before any compute.

    python scripts/inspect_corpus.py $DOLMA3_DIR --config configs/pretrain_350m_20b.yaml
    python scripts/inspect_corpus.py $DOLMA3_DIR --config configs/pretrain_350m_20b.yaml --data.unclaimed 0.01

Prints the distinct ``source`` and ``category`` values with rows, tokens (``token_count``) and share,
and, with ``--config``, the mixture source each value goes to under the config's ``filter:`` blocks
(``-`` for none) and the start-up mapping report (data/mapping.py: per source and pattern the values
matched; the unclaimed values; a pattern matching nothing, unclaimed values above ``data.unclaimed`` or
a value claimed twice are marked ``error:`` as ``train fit`` would refuse them). The report covers the
files each source's globs select, as ``train fit`` selects them (data/source_files.py). Then a ``sources:``
block for the values found, ready to paste, and duplicate-text counts on a sample of rows
(``--sample-rows``; the Dolma 3 mix upsamples documents, so some repeat). Reads only the small columns,
except the sampled texts. Library: data/corpus/inspect.py.

Exit status 0; 1 when the config's mapping has errors (``train fit`` would refuse it); 2 with
``error: ...`` when the folder holds no parquet file, is an incomplete global-shuffle output, or the
config is unreadable or refused where ``train fit`` refuses its files (a glob matching nothing, a file two
sources claim: fit's line). The data section is resolved as ``python -m train fit`` resolves it, without
torch (data/config.py resolve_data_config): stacked ``--config`` files, ``PL_FIT__DATA__*`` and ``--data.*``.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys

from data.config import ToolParser, resolve_data_config, split_tool_args
from data.corpus.inspect import (
    duplicate_counts,
    format_duplicates,
    format_report,
    inspect_corpus,
    propose_sources,
    summarize,
)
from data.errors import ConfigError, one_line_errors
from data.mapping import build_mapping
from data.shuffled import shuffle_problems
from data.source_files import list_files


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="corpus folder (searched recursively for parquet files)")
    p.add_argument("--pattern", default="**/*.parquet", help="glob under DIR (default **/*.parquet)")
    p.add_argument("--sample-rows", type=int, default=20_000,
                   help="rows whose texts are checked for duplicates (default 20,000; 0: skip)")
    p.add_argument("--paths", default="$DOLMA3_DIR/**/*.parquet", help="the glob the proposed sources block reads")
    p.epilog = ("Also: --config FILE (repeatable: stacked as train fit stacks them) and --data.* overrides, "
                "whose data.sources globs and filters are read as train fit reads them.")
    return p


def scanned(folder: str, pattern: str):
    """The folder's summary (data/corpus/inspect.py); ConfigError for no parquet file or an incomplete shuffle."""
    try:
        summary = inspect_corpus(folder, pattern)
    except FileNotFoundError as e:  # no parquet file in the folder
        raise ConfigError(str(e)) from None
    incomplete = shuffle_problems(summary.paths)
    if incomplete:
        raise ConfigError("\n".join(incomplete))
    return summary


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    own, rest = split_tool_args(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    cfg = resolve_data_config(rest) if rest else None  # the run's data config, as train fit resolves it
    files_per_source = list_files(cfg) if cfg is not None else {}  # the files fit reads; what it refuses, refused
    summary = scanned(args.dir, args.pattern)
    mapping = None  # the config's filters over the files each source reads: the start-up mapping report
    if cfg is not None:
        read = sorted({p for files in files_per_source.values() for p in files})
        values = summary if set(read) <= set(summary.paths) else summarize(read)  # files outside DIR too
        mapping = build_mapping(cfg, files_per_source, values.per_file)
    print(format_report(summary, mapping))
    if mapping is not None:
        print("\n" + mapping.text())
    if summary.values["source"]:
        print("\n" + propose_sources(summary, args.paths))
    if args.sample_rows > 0:
        print("\n" + format_duplicates(duplicate_counts(summary.paths, args.sample_rows)))
    return 1 if mapping is not None and mapping.errors else 0


if __name__ == "__main__":
    sys.exit(main())
