"""Split a mixed corpus (e.g. a globally shuffled one) into one shard set per mixture source.

    python scripts/split_by_source.py 'shuffled/*.parquet' --out by_source --column source \\
        --map 'web=common_crawl*' --map 'code=stack[-_]edu*' --map 'pdfs=olmocr*,s2pdf*' --map 'curated=finemath*,rpj*'

What it does, the options' meaning and the measurements: the library, ``data/corpus/split.py``.
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
import time

from data.corpus.shuffle import list_inputs
from data.corpus.split import parse_map, split_by_source
from data.errors import ConfigError, one_line_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", metavar="IN_GLOB", help="parquet files or globs (quote them)")
    p.add_argument("--out", required=True, help="output directory: OUT/<source>/part-NNNNN.parquet")
    p.add_argument("--column", default="source", help="column the patterns match (default source)")
    p.add_argument(
        "--map", action="append", default=[], metavar="NAME=PAT,PAT", help="mixture source and its patterns (repeat)"
    )
    p.add_argument("--unmapped", help="folder for rows matching no mapping (default: counted and left out)")
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when rows matched no mapping (and --unmapped is not given)"
    )
    p.add_argument("--row-group-rows", type=int, default=1024, help="rows per output row group (default 1024)")
    p.add_argument("--rows-per-part", type=int, default=100_000, help="rows per output file (default 100000)")
    p.add_argument("--compression", default="zstd")
    p.add_argument("--overwrite", action="store_true", help="replace existing part files in OUT")
    return p.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mapping = parse_map(args.map)
    if args.row_group_rows < 1 or args.rows_per_part < 1:
        raise ConfigError("--row-group-rows and --rows-per-part must be >= 1")
    inputs = list_inputs(args.inputs)
    t0 = time.perf_counter()
    report = split_by_source(inputs, args.out, mapping, column=args.column, unmapped=args.unmapped,
                             row_group_rows=args.row_group_rows, rows_per_part=args.rows_per_part,
                             compression=args.compression, overwrite=args.overwrite)
    _print_report(report, args, len(inputs), time.perf_counter() - t0)
    return 1 if args.strict and report["unmapped"] and not args.unmapped else 0


def _print_report(report: dict, args: argparse.Namespace, files: int, seconds: float) -> None:
    print(f"{report['rows_in']:,} rows from {files} file(s) in {seconds:.2f}s -> {args.out}")
    for name, rows in report["rows_per_source"].items():
        print(f"  {name:<12} {rows:>10,} rows  {report['parts_per_source'][name]} part(s)")
    if report["ambiguous_values"]:
        print(f"  note: value(s) matched by more than one mapping (first wins): {report['ambiguous_values']}")
    if report["unmapped"]:
        where = f"kept in {args.unmapped}/" if args.unmapped else "LEFT OUT"
        print(f"  unmapped ({where}): " + ", ".join(f"{v} {n:,}" for v, n in sorted(report["unmapped"].items())))


if __name__ == "__main__":
    sys.exit(main())
