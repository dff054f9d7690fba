"""Data cursors at cluster scale: size, per-rank files and the elastic re-cut, on synthetic cursors.

    python scripts/bench_elastic.py                      # 2,048 consumers (512 ranks x 4 workers) -> 1,024
    python scripts/bench_elastic.py --consumers 256 --buffer 2000   # a quick run

Synthetic version-2 cursors of the real defaults' shape: bytes per cursor, the per-rank cursor file
(written and read back), what a rank reads on resume, the re-cut to ``--to`` consumers for one rank's
cursors and for all, peak RSS. Target: the re-cut at 2,048 consumers in <= 10 s. How it measures, and
the figures: docs/benchmarks.md.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from data.cursor import CURSOR_VERSION, pack_ints
from data.elastic import redistribute
from train.cursor_files import load_checkpoint_cursors, rank_file, save_rank_cursors

SOURCES = ["web", "code", "books", "curated"]


def synthetic_cursor(c: int, n: int, args, rng: np.random.Generator) -> dict:
    def addrs(k: int) -> np.ndarray:
        return np.stack([rng.integers(0, 3000, k), rng.integers(0, 100_000, k), np.zeros(k, np.int64)], 1)

    sources = {}
    for s, name in enumerate(SOURCES):
        sources[name] = {
            "taken": 3 + c % 2,
            "open": [[int(c + (3 + i) * n), int(rng.integers(0, 500))] for i in range(args.open_chunks)],
            "buffer": pack_ints(addrs(args.buffer)),
            "rng": np.random.PCG64([c, s]).state,
        }
    rows = [[int(rng.integers(0, 4)), int(rng.integers(0, 3000)), int(rng.integers(0, 100_000)), 0,
             int(rng.integers(0, 4000))] for _ in range(args.batch)]
    return {
        "version": CURSOR_VERSION, "fingerprint": "synthetic", "seed": 0, "consumer": c, "num_consumers": n,
        "next_step": 1000, "sources": sources, "rows": rows, "continuations": [],
        "mixer": {"emitted": [1000] * 4, "committed": [1100] * 4, "target": [1000.0] * 4,
                  "rng": np.random.PCG64([c, 11]).state},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--consumers", type=int, default=2048)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--to", type=int, default=None, help="consumers after the re-cut (default: half)")
    p.add_argument("--buffer", type=int, default=10_000)
    p.add_argument("--open-chunks", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--files", type=int, default=4, help="rank files written and read back to measure")
    args = p.parse_args(argv)
    n, workers = args.consumers, args.workers
    to = args.to or n // 2
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    flat = [synthetic_cursor(c, n, args, rng) for c in range(n)]
    build_s = time.perf_counter() - t0
    sizes = [len(json.dumps(cur)) for cur in flat[:16]]
    per = sum(sizes) / len(sizes)
    cursors = [flat[r * workers:(r + 1) * workers] for r in range(n // workers)]
    file_bytes, load_s = rank_files(cursors[:args.files])
    manifest = SimpleNamespace(source_names=SOURCES, fingerprint=lambda: "synthetic")
    t0 = time.perf_counter()
    new = redistribute(cursors, manifest, seed=0, world_size=to // workers, num_workers=workers,
                       batch_size=args.batch, resume_step=1000, ranks=[0])  # what each rank runs
    recut_s = time.perf_counter() - t0
    assert sum(len(r) for r in new) == to and all(c is not None for c in new[0])
    t0 = time.perf_counter()
    everyone = redistribute(cursors, manifest, seed=0, world_size=to // workers, num_workers=workers,
                            batch_size=args.batch, resume_step=1000)
    all_s = time.perf_counter() - t0
    assert [c.to_dict()["sources"] for c in everyone[0]] == [c.to_dict()["sources"] for c in new[0]]
    moved = sum(len(cur.sources[s].open) for r in everyone for cur in r for s in SOURCES)
    print(f"{n} consumers ({n // workers} ranks x {workers} workers), 4 sources x buffer {args.buffer:,} x "
          f"{args.open_chunks} open chunks, micro-batch {args.batch}; synthetic cursors built in {build_s:.1f} s")
    print(f"  cursor per consumer      {per / 1e3:8.1f} KB (JSON, packed buffers)")
    ranks = n // workers
    print(f"  cursor file per rank     {file_bytes / 1e6:8.2f} MB ({workers} workers' cursors; written by each rank at "
          f"each checkpoint; {file_bytes * ranks / 1e6:,.0f} MB on disk for all {ranks} ranks)")
    print(f"  read per rank, resume    {file_bytes / 1e6:8.2f} MB in {load_s * 1e3:.0f} ms with the same layout "
          f"(its own file); {file_bytes * ranks / 1e6:,.0f} MB, ~{load_s * ranks:.1f} s elastic (all {ranks} files)")
    print(f"  re-cut {n} -> {to}, one rank's cursors   {recut_s:6.2f} s   (what each rank runs; target <= 10 s)")
    print(f"  re-cut {n} -> {to}, every cursor         {all_s:6.2f} s   ({moved:,} open chunks dealt)")
    print(f"  peak RSS                 {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:8.2f} GB")
    return 0


def rank_files(rows: list[list[dict]]) -> tuple[float, float]:
    """Mean size (bytes) and load time (s) of per-rank cursor files, written and read as training does."""
    with tempfile.TemporaryDirectory() as tmp:
        for rank, row in enumerate(rows):
            save_rank_cursors(tmp, rank, row, next_step=1000)
        size = sum(rank_file(tmp, r).stat().st_size for r in range(len(rows))) / len(rows)
        state = {"cursor_dir": ".", "world_size": len(rows), "next_step": 1000}
        t0 = time.perf_counter()
        loaded = load_checkpoint_cursors(Path(tmp) / "x.ckpt", state)  # the index's folder is the checkpoint's
        load_s = (time.perf_counter() - t0) / len(rows)
    assert loaded == rows
    return size, load_s


if __name__ == "__main__":
    sys.exit(main())
