"""Globally shuffle a parquet corpus into N buckets (the dolma3_300B_sample_shuffled procedure).

Dolma3 sample files are clustered by sub-source, so small training buffers see non-uniform mixes.
Every row is assigned uniformly at random to one of N buckets, then each bucket is shuffled in
memory and written as parquet with the input's schema::

    python scripts/global_shuffle.py 'dolma3/**/*.parquet' --out shuffled --buckets 200 --seed 42 --workers 16
    python scripts/global_shuffle.py 'demo_corpus/*/*.parquet' --out /tmp/demo_shuffled --buckets 8

Phases (data/corpus/shuffle.py: what each writes, the checks, memory and restart rules): *scatter*
into parts under ``--tmp`` (default ``OUT/_shuffle_tmp``; 1.3-2x the input's size free); *gather*
into ``OUT/bucket-00042.parquet`` (about 3 x corpus / N + ~120 MB per worker: pick N so that fits);
*report*, which verifies the buckets, writes ``OUT/shuffle_report.json`` and deletes the parts
(``--keep-tmp`` keeps them). Rerun the same command after an interruption: what is done is skipped;
delete a bucket and rerun, and only that bucket is rebuilt (identical bytes).
``--report-only`` re-verifies the buckets, reading their rows (``--workers`` processes), and rewrites the
record (as one of an older version must be).
Exit status: 0 when verified, 1 when a check fails, 2 for bad arguments or input.

On a cluster the phases run as SLURM job arrays, scatter over input files, gather over buckets::

    python scripts/global_shuffle.py IN --out OUT --scatter-only --task-index $SLURM_ARRAY_TASK_ID --num-tasks 64
    python scripts/global_shuffle.py IN --out OUT --gather-only  --task-index $SLURM_ARRAY_TASK_ID --num-tasks 50
    python scripts/global_shuffle.py IN --out OUT --report-only

Task i handles files (or buckets) i, i+T, i+2T, ...; every task must be given the same inputs,
--buckets and --seed (a fingerprint of them is checked). ``scripts/slurm/global_shuffle.sbatch``
is the job-array template, with the submission commands chaining the three phases.
"""

from __future__ import annotations

try:  # first: outside the environment, one line on how to set it up (scripts/_env.py)
    import _env  # noqa: F401
except ImportError:  # loaded by path (a test, runpy): the caller's environment
    pass

import argparse
import os
import sys
import time
from pathlib import Path

# Arrow's allocator, for this process and the workers it spawns (they inherit the environment). The
# system allocator hands freed buffers back; mimalloc, Arrow's default, kept about 90 MB more at the
# peak of a gather over 64 buckets, at the same speed (scripts/bench_shuffle.py).
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from data.corpus.shuffle import (
    ShuffleSpec,
    cleanup,
    format_report,
    gather,
    list_inputs,
    scatter,
    shuffle,
    verify,
    write_report,
)
from data.errors import ConfigError, one_line_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", metavar="IN_GLOB", help="parquet files or globs (quote them)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--buckets", type=int, default=200, help="number of output files (default 200)")
    p.add_argument("--seed", type=int, default=42, help="seed of the assignment and of every permutation (default 42)")
    p.add_argument("--workers", type=int, default=1, help="processes per task (default 1)")
    p.add_argument("--tmp", help="directory for scatter parts (default OUT/_shuffle_tmp)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the scatter parts after a verified run")
    phase = p.add_mutually_exclusive_group()
    phase.add_argument("--scatter-only", action="store_true", help="run scatter task --task-index of --num-tasks")
    phase.add_argument("--gather-only", action="store_true", help="run gather task --task-index of --num-tasks")
    phase.add_argument("--report-only", action="store_true", help="verify, write the report, clean up")
    p.add_argument("--task-index", type=int, default=0)
    p.add_argument("--num-tasks", type=int, default=1)
    p.add_argument("--source-column", default="source", help="column whose shares are checked (default source)")
    p.add_argument("--token-column", default="token_count", help="column summed as tokens (default token_count)")
    p.add_argument("--text-column", default="text", help="column hashed for the checksum (default text)")
    p.add_argument("--buffer-mb", type=float, default=256.0, help="scatter buffer per task (default 256)")
    p.add_argument("--row-group-rows", type=int, default=1024, help="rows per output row group (default 1024)")
    p.add_argument("--compression", default="zstd", help="output parquet compression (default zstd)")
    p.add_argument("--quiet", action="store_true", help="no per-task progress lines")
    return p.parse_args(argv)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = ShuffleSpec(
        inputs=list_inputs(args.inputs),
        out=args.out,
        buckets=args.buckets,
        seed=args.seed,
        tmp=args.tmp,
        source_column=args.source_column,
        token_column=args.token_column or None,
        text_column=args.text_column,
        buffer_mb=args.buffer_mb,
        row_group_rows=args.row_group_rows,
        compression=args.compression,
    )
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (got {args.workers})")
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    print(
        f"{len(spec.inputs)} input file(s) -> {spec.buckets} buckets in {spec.out} (seed {spec.seed})", flush=True
    )
    t0 = time.perf_counter()

    def progress(phase: str, result: dict) -> None:
        if args.quiet:
            return
        what = f"bucket {result['bucket']}" if phase == "gather" else result["file"]
        rows = result["stats"]["rows"]
        print(f"  {phase} {'skipped (done)' if result['skipped'] else 'done'}: {what} ({rows:,} rows) "
              f"[{time.perf_counter() - t0:.1f}s]", flush=True)

    if args.scatter_only:
        done = scatter(spec, args.task_index, args.num_tasks, args.workers, lambda r: progress("scatter", r))
        print(f"scatter task {args.task_index}/{args.num_tasks}: {len(done)} file(s) done")
        return 0
    if args.gather_only:
        done = gather(spec, args.task_index, args.num_tasks, args.workers, progress=lambda r: progress("gather", r))
        print(f"gather task {args.task_index}/{args.num_tasks}: {len(done)} bucket(s) done")
        return 0
    if args.report_only:
        report = verify(spec, workers=args.workers)
        write_report(spec, report)
        if report["ok"] and not args.keep_tmp:
            cleanup(spec)
    else:
        report = shuffle(spec, workers=args.workers, keep_tmp=args.keep_tmp, progress=progress)
    print(format_report(report))
    print(f"report: {Path(spec.out) / 'shuffle_report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
