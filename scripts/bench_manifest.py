"""Cold manifest build: files scanned one at a time vs in parallel threads, in one process.

    python scripts/bench_manifest.py DIR [--threads N] [--rounds 3]

DIR is a Dolma3-shaped corpus from scripts/make_scale_corpus.py (every file mixes all sub-sources;
four mixture sources filter the `source` column, as the real config does). Each round builds the
manifest cold (an empty cache dir) with one scan thread, then with N, alternating; the speed-up is
the median of per-round ratios. Also timed: a warm build (every entry cached), and 4 "ranks"
(threads) starting at once on one cold cache, where one scans and the others wait on the lock.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import data.manifest as manifest_mod
from data.config import DataConfig
from data.corpus.scale import scale_sources
from data.manifest import build_manifest
from data.schedules import fixed_schedule


def config(corpus: str, cache: str) -> DataConfig:
    sources = scale_sources(corpus)
    return DataConfig(sources=sources, schedule=fixed_schedule({n: 1 / len(sources) for n in sources}, 2048),
                      manifest_cache=cache, val_tokens_per_source=0)


def timed_build(corpus: str, cache: str, threads: int) -> float:
    manifest_mod.SCAN_THREADS = threads
    t0 = time.perf_counter()
    build_manifest(config(corpus, cache))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--threads", type=int, default=manifest_mod.SCAN_THREADS)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    files = len(list(Path(args.dir).glob("*.parquet")))
    one, many, ratios = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            one.append(timed_build(args.dir, a, 1))
            many.append(timed_build(args.dir, b, args.threads))
            warm = timed_build(args.dir, b, args.threads)
        ratios.append(one[-1] / many[-1])
    with tempfile.TemporaryDirectory() as cache:
        manifest_mod.SCAN_THREADS = args.threads
        ranks = [threading.Thread(target=build_manifest, args=(config(args.dir, cache),)) for _ in range(4)]
        t0 = time.perf_counter()
        for t in ranks:
            t.start()
        for t in ranks:
            t.join()
        four = time.perf_counter() - t0
    print(f"manifest of {files} files x 4 filtered sources, {args.rounds} alternating rounds")
    print(f"  cold, 1 scan thread        {statistics.median(one):7.2f} s")
    print(f"  cold, {args.threads:>2} scan threads      {statistics.median(many):7.2f} s   "
          f"speed-up (median of rounds) {statistics.median(ratios):.2f}x")
    print(f"  warm (cached)              {warm:7.2f} s")
    print(f"  4 ranks at once, cold      {four:7.2f} s   (one scans, three wait and read the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
