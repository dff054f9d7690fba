"""Benchmark scripts/global_shuffle.py: throughput on 2 cores, and peak memory against the bucket size.

    python scripts/bench_shuffle.py                       # demo corpus (built in a temp dir) + 256 MB synthetic
    python scripts/bench_shuffle.py --corpus demo_corpus --synthetic-mb 512
    python scripts/bench_shuffle.py --quick               # smoke run: 32 MB synthetic, fewer bucket counts

(a) throughput of the whole run, ``--workers 2``, on the demo corpus and a synthetic clustered one;
(b) peak RSS of scatter and of gather against the largest bucket's decoded size, ``--workers 1``. How
each part measures, and the figures: docs/benchmarks.md. Absolute times are noisy; read the ratios.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.config import arrow_schema
from data.corpus.demo import build_demo_corpus

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "global_shuffle.py"
# Runs a command and prints the peak RSS (KB on Linux) of its whole process tree (reaped children included).
RSS_WRAPPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)
SCHEMA = arrow_schema()


def synthetic_corpus(out: Path, total_mb: float, files: int = 16, sub_sources: int = 20, seed: int = 0) -> Path:
    """Clustered Dolma3-like parquet files: file i holds sub-source i % sub_sources only."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    per_file = int(total_mb * 2**20 / files)
    for i in range(files):
        lengths = np.clip(rng.lognormal(mean=7.6, sigma=1.0, size=per_file // 1000 + 10), 50, 200_000).astype(np.int64)
        lengths = lengths[np.cumsum(lengths) <= per_file] if lengths.sum() > per_file else lengths
        chars = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum()), dtype=np.uint8)
        chars[rng.random(chars.size) < 0.18] = ord(" ")
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        text = pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets.tobytes()), pa.py_buffer(chars.tobytes()))
        sub = f"synthetic_{i % sub_sources:02d}"
        n = len(lengths)
        table = pa.table({
            "source": pa.array([sub] * n), "date": pa.array(["2024-01-01"] * n), "text": text,
            "token_count": pa.array(lengths // 4), "category": pa.array([sub.split("_")[0]] * n),
        }, schema=SCHEMA)
        pq.write_table(table, out / f"{sub}-{i:04d}.parquet", row_group_size=max(1, n // 8), compression="zstd")
    return out


def corpus_size(files: list[Path]) -> dict:
    rows = disk = text = 0
    for f in files:
        meta = pq.read_metadata(f)
        rows += meta.num_rows
        disk += f.stat().st_size
        text += pq.read_table(f, columns=["text"]).column("text").combine_chunks().buffers()[2].size
    return {"rows": rows, "disk_mb": disk / 2**20, "text_mb": text / 2**20}


def run(args: list[str], rss: bool = False) -> tuple[float, int | None, str]:
    """(seconds, peak RSS in MB or None, stdout) of a command; exits on failure."""
    cmd = [sys.executable, "-c", RSS_WRAPPER, *args] if rss else args
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stdout}\n{r.stderr}")
    peak = None
    if rss:
        line = [x for x in r.stdout.splitlines() if x.startswith("PEAK_RSS_KB")][-1]
        peak = int(line.split()[1]) // 1024
    return elapsed, peak, r.stdout


def shuffle_cmd(glob_: str, out: Path, buckets: int, workers: int, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), glob_, "--out", str(out), "--buckets", str(buckets), "--workers", str(workers),
            "--quiet", *extra]


def throughput(name: str, glob_: str, size: dict, tmp: Path, buckets: int, repeats: int) -> None:
    best = None
    for r in range(repeats):
        out = tmp / f"tp-{name}-{r}"
        seconds, _, stdout = run(shuffle_cmd(glob_, out, buckets, 2))
        report = json.loads((out / "shuffle_report.json").read_text())
        assert report["ok"], stdout
        best = seconds if best is None else min(best, seconds)
        phases = report["run"]
    print(f"  {name:<10} {size['rows']:>9,} rows {size['disk_mb']:>7.1f} MB parquet {size['text_mb']:>7.1f} MB text, "
          f"{buckets} buckets, 2 workers: {best:6.2f}s = {size['rows'] / best:>9,.0f} rows/s, "
          f"{size['disk_mb'] / best:6.1f} MB/s parquet, {size['text_mb'] / best:6.1f} MB/s text "
          f"(last run: scatter {phases['scatter_s']:.2f}s, gather {phases['gather_s']:.2f}s)")


def memory(glob_: str, tmp: Path, bucket_counts: list[int], buffer_mb: float) -> None:
    _, base, _ = run([sys.executable, "-c", "import data.corpus.shuffle"], rss=True)
    print(f"  RSS of a process that imported the tool: {base} MB; scatter buffer --buffer-mb {buffer_mb:g}")
    print(f"  {'buckets':>7} {'largest bucket':>15} {'scatter peak':>13} {'gather peak':>12} "
          f"{'(gather - base) / bucket':>25}")
    points = []
    for n in bucket_counts:
        out = tmp / f"mem-{n}"
        extra = ("--buffer-mb", str(buffer_mb), "--keep-tmp")
        _, scatter_peak, _ = run(shuffle_cmd(glob_, out, n, 1, "--scatter-only", *extra), rss=True)
        _, gather_peak, _ = run(shuffle_cmd(glob_, out, n, 1, "--gather-only", *extra), rss=True)
        run(shuffle_cmd(glob_, out, n, 1, "--report-only"))
        assert json.loads((out / "shuffle_report.json").read_text())["ok"]
        largest = max(sum(m.row_group(i).total_byte_size for i in range(m.num_row_groups))
                      for m in (pq.read_metadata(p) for p in out.glob("bucket-*.parquet"))) / 2**20
        print(f"  {n:>7} {largest:>12.1f} MB {scatter_peak:>10} MB {gather_peak:>9} MB "
              f"{(gather_peak - base) / largest:>24.2f}x")
        points.append((largest, gather_peak))
    if len(points) >= 2:
        x, y = np.array(points, dtype=float).T
        slope, intercept = np.polyfit(x, y, 1)
        print(f"  least-squares fit over the {len(points)} runs: gather peak RSS = {intercept:.0f} MB + "
              f"{slope:.2f} x largest bucket (decoded)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="demo-corpus directory DIR/<source>/*.parquet (default: build one in a temp dir)")
    p.add_argument("--synthetic-mb", type=float, default=256, help="size of the synthetic corpus (0: skip)")
    p.add_argument("--buckets", type=int, nargs="+", default=[4, 16, 64], help="bucket counts of the memory sweep")
    p.add_argument("--buffer-mb", type=float, default=64, help="scatter buffer in the memory sweep")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="32 MB synthetic, buckets 4 and 16, one repeat")
    args = p.parse_args()
    if args.quick:
        args.synthetic_mb, args.buckets, args.repeats = min(args.synthetic_mb, 32), [4, 16], 1
    print(f"machine: {os.cpu_count()} cores visible, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        corpus = Path(args.corpus) if args.corpus else None
        if corpus is None:
            corpus = tmp / "demo"
            build_demo_corpus(corpus)
        demo_glob = str(corpus / "*" / "*.parquet")
        print("(a) throughput, whole run (scatter + gather + verify), --workers 2")
        throughput("demo", demo_glob, corpus_size(sorted(corpus.glob("*/*.parquet"))), tmp, 16, args.repeats)
        if args.synthetic_mb > 0:
            synth = synthetic_corpus(tmp / "synthetic", args.synthetic_mb)
            synth_glob = str(synth / "*.parquet")
            throughput("synthetic", synth_glob, corpus_size(sorted(synth.glob("*.parquet"))), tmp, 16, args.repeats)
            print("(b) peak RSS against the bucket size, synthetic corpus, --workers 1, one process per phase")
            memory(synth_glob, tmp, args.buckets, args.buffer_mb)


if __name__ == "__main__":
    main()
