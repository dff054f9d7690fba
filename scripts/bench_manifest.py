"""Cold manifest build: files scanned one at a time vs in parallel threads, in one process; and the
first steps of one consumer as a data tool runs them, with and without torch and Lightning loaded.

    python scripts/bench_manifest.py DIR [--threads N] [--rounds 3]
    python scripts/bench_manifest.py DIR --consumer [--rounds 3]

DIR is a Dolma3-shaped corpus from scripts/make_scale_corpus.py (every file mixes all sub-sources;
four mixture sources filter the `source` column, as the real config does). Each round builds the
manifest cold (an empty cache dir) with one scan thread, then with N, alternating; the speed-up is
the median of per-round ratios. Also timed: a warm build (every entry cached), and 4 "ranks"
(threads) starting at once on one cold cache, where one scans and the others wait on the lock.

``--consumer``: wall time and peak RSS of ``scripts/dump_order.py --steps 3 --world-size 1 --num-workers 1``
with configs/demo.yaml's data settings and its four sources filtering DIR's files, in a fresh process on a
warm manifest cache, alternating the light path (the data section resolved by data/config.py, no torch)
with the same run after ``import train.config`` (torch and Lightning loaded, as when the tools resolved
their configuration through the Lightning parser); medians of the rounds, side by side.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

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


DUMP_ORDER = Path(__file__).resolve().parent / "dump_order.py"
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
HEAVY = "import runpy, sys, train.config; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
"""dump_order run after ``import train.config``: torch and Lightning loaded first."""


def consumer_config(corpus: str, folder: str) -> Path:
    """The demo config's four sources as filters on the scale corpus (stacked over configs/demo.yaml)."""
    sources = {name: dataclasses.asdict(src) for name, src in scale_sources(corpus).items()}
    path = Path(folder) / "scale_sources.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": sources}}))
    return path


def consumer_run(config: Path, cache: str, heavy: bool) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of dump_order's first 3 steps of one consumer, in a fresh process."""
    command = [sys.executable, *(["-c", HEAVY] if heavy else []), str(DUMP_ORDER), "--config", str(DEMO_CONFIG),
               "--config", str(config), "--steps", "3", "--world-size", "1", "--num-workers", "1", "--out", os.devnull]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env={**os.environ, "WELLMIXED_CACHE": cache}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(command)}")
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # KiB on Linux


def consumer_figures(corpus: str, rounds: int) -> None:
    """The light path and the torch-loaded one, alternating, on one warm manifest cache."""
    with tempfile.TemporaryDirectory() as folder:
        config, cache = consumer_config(corpus, folder), str(Path(folder) / "cache")
        consumer_run(config, cache, heavy=False)  # builds the manifest cache
        runs = [[consumer_run(config, cache, heavy) for heavy in (False, True)] for _ in range(rounds)]
    print(f"first 3 steps of one consumer (dump_order --config configs/demo.yaml + the scale corpus's sources, "
          f"1 rank x 1 worker), {rounds} alternating rounds, warm manifest cache (medians)")
    for i, label in enumerate(("light (data/config.py)", "after import train.config")):
        wall, cpu, rss = (statistics.median(run[i][k] for run in runs) for k in range(3))
        print(f"  {label:<27} {wall:7.2f} s wall  {cpu:7.2f} s CPU  {rss:6.0f} MB peak RSS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--threads", type=int, default=manifest_mod.SCAN_THREADS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--consumer", action="store_true", help="time one consumer's first 3 steps instead")
    args = p.parse_args(argv)
    if args.consumer:
        consumer_figures(args.dir, args.rounds)
        return 0
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
