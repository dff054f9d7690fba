"""Build the embedded demo corpus (offline, from CPython's own files; see data/corpus/demo.py).

    python scripts/make_demo_corpus.py --out demo_corpus [--force]
"""

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
import time
from pathlib import Path

from data.corpus.demo import build_demo_corpus, format_summary
from data.errors import one_line_errors


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="writes <out>/<source>/<shard>.parquet")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out holds this corpus")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    summary = build_demo_corpus(args.out, force=args.force)
    elapsed = time.perf_counter() - start
    print(format_summary(summary))
    if summary["reused"]:
        print(f"{args.out} already holds this corpus (use --force to rebuild)")
    else:
        print(f"built {args.out} in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
