"""Write a synthetic corpus with the shape of dolma3_300B_sample_shuffled (library: data/corpus/scale.py).

    python scripts/make_scale_corpus.py --out scale_corpus                     # 4 files x 100k rows
    python scripts/make_scale_corpus.py --out /tmp/sc --files 2 --rows 8000 --row-group 8000
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
from pathlib import Path

from data.corpus import scale
from data.corpus.scale import make_scale_corpus
from data.errors import ConfigError, one_line_errors


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=scale.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000, help="rows per file")
    p.add_argument("--row-group", type=int, default=100_000, help="rows per row group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", type=Path, default=None, help="demo corpus to take text from (default: build one)")
    p.add_argument("--small-pages", action="store_true",
                   help="~1 MiB data pages, as this repo's corpus tools write (default: pyarrow's, ~1,024 rows a page)")
    args = p.parse_args(argv)
    if min(args.files, args.rows, args.row_group) < 1:
        raise ConfigError("--files, --rows and --row-group must be >= 1")
    tokens = make_scale_corpus(args.out, args.files, args.rows, args.row_group, args.seed, args.demo, args.small_pages)
    print(f"wrote {args.files} files x {args.rows:,} rows ({args.row_group:,} per row group), "
          f"~{tokens / 1e6:.1f}M tokens, into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
