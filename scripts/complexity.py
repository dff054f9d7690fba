"""Measure the code's shape with radon: functions over 60 lines and blocks at complexity D or worse.

    python scripts/complexity.py                 # data/ train/ ablations/ scripts/ (tests are not counted)
    python scripts/complexity.py data/manifest.py train
    python scripts/complexity.py --max-lines 60 --rank D

Prints each offending function (path:line name, lines, complexity rank and score), then the totals:
non-test source lines, functions over the line limit, blocks at the rank or worse, and each per 1k
lines. Needs radon (`pip install radon`); exits 2 with that line when it is missing.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import sys
from pathlib import Path

from data.errors import one_line_errors

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FOLDERS = ("data", "train", "ablations", "scripts")
RANKS = "ABCDEF"


def python_files(targets: list[str]) -> list[Path]:
    out: list[Path] = []
    for target in targets:
        path = Path(target) if Path(target).is_absolute() else ROOT / target
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def functions(blocks: list) -> list:
    """Functions and methods (a class is not a block of its own; closures count in their function)."""
    out = []
    for block in blocks:
        out.extend(block.methods if hasattr(block, "methods") else [block])
    return out


def measure(path: Path, max_lines: int, worst_rank: str) -> tuple[int, list[str], list[str]]:
    """(source lines, functions over ``max_lines``, blocks at ``worst_rank`` or worse) of one file."""
    from radon.complexity import cc_rank, cc_visit
    from radon.raw import analyze

    text = path.read_text()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    long, complex_ = [], []
    for item in functions(cc_visit(text)):
        lines = item.endline - item.lineno + 1
        rank = cc_rank(item.complexity)
        where = f"{name}:{item.lineno} {item.fullname}"
        if lines > max_lines:
            long.append(f"{where}  {lines} lines")
        if RANKS.index(rank) >= RANKS.index(worst_rank):
            complex_.append(f"{where}  {rank} ({item.complexity})")
    return analyze(text).sloc, long, complex_


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", default=list(DEFAULT_FOLDERS), help="files or folders (default: %(default)s)")
    p.add_argument("--max-lines", type=int, default=60, help="longest function allowed (default: %(default)s)")
    p.add_argument("--rank", choices=list(RANKS), default="D", help="worst complexity rank reported (default: D)")
    args = p.parse_args(argv)
    try:
        import radon  # noqa: F401
    except ImportError:
        print("complexity.py needs radon: pip install radon", file=sys.stderr)
        return 2

    sloc, long, complex_ = 0, [], []
    for path in python_files(args.paths):
        n, file_long, file_complex = measure(path, args.max_lines, args.rank)
        sloc += n
        long += file_long
        complex_ += file_complex
    print(f"functions over {args.max_lines} lines:")
    print("\n".join(f"  {line}" for line in long) or "  none")
    print(f"blocks at complexity {args.rank} or worse:")
    print("\n".join(f"  {line}" for line in complex_) or "  none")
    per_k = 1000 / sloc if sloc else 0.0
    print(f"totals: {sloc} source lines; {len(long)} functions over {args.max_lines} lines "
          f"({len(long) * per_k:.2f} per 1k lines); {len(complex_)} blocks at {args.rank} or worse "
          f"({len(complex_) * per_k:.2f} per 1k lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
