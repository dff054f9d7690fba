"""Corpus tools: the global bucket shuffle, streaming over parquet row groups (scripts/split_by_source.py
reuses its helpers).

Global shuffle -- the dolma3_300B_sample_shuffled procedure -- in two phases::

    scatter  one task per input file: read it a row group at a time, send every row to a bucket drawn
             uniformly at random (RNG seeded from (seed, file index)), keep the rows per bucket in
             memory and flush them as part files TMP/f-00017/b-00042-p0000.parquet whenever the
             buffered rows pass ``buffer_mb``. The task writes into TMP/f-00017.partial/, renames it
             to TMP/f-00017/ when done, then writes its done marker TMP/f-00017.json (rows, checksum,
             per-source counts of the file, rows sent to each bucket).
    gather   one task per bucket, once every scatter marker exists: read the bucket's parts in file
             order, permute them in memory (RNG seeded from (seed, bucket)), write OUT/bucket-00042.parquet
             through a temp file and a rename. The footer carries the bucket's statistics and the run
             identity (seed, buckets, fingerprint of the input files).

Every random choice is a function of (seed, file index) or (seed, bucket), so the output is the same
however the tasks are spread over processes or array jobs, and whatever the buffer size. Memory is
bounded by ``buffer_mb`` plus one input row group in scatter, and in gather by one bucket's parts
plus their contiguous copy (then the copy and one output row group): measured by
scripts/bench_shuffle.py at ~120 MB + 3x the bucket's decoded size (309 MB for a 65 MB bucket),
where N buckets hold corpus / N each.

Restarting is always safe: a scatter task with a marker and an output bucket whose footer names this
run are skipped; half-written temp files never have the final name. ``verify`` compares input and
output: rows, an order-independent checksum of the texts (sum mod 2^64 of a 64-bit BLAKE2b per text:
a lost or duplicated row changes it), per-source row totals, and each bucket's source shares against
the multinomial sampling error of a uniform assignment (data/corpus/rowstats.py). A bucket it did not
write in this invocation is read again and its rows' statistics compared with those written into its
footer, never taken from the footer it verifies. The report pins each bucket's rows, size and footer
hash for the readers, and a hash of itself (data/shuffled.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import files
from data.corpus import PAGE_OPTIONS
from data.corpus.rowstats import RowStats, source_share_check
from data.errors import ConfigError
from data.shuffled import REPORT, record_checksum, record_intact
from data.source_files import glob_each

log = logging.getLogger(__name__)

SHUFFLE_VERSION = 1  # bump when the assignment or permutation changes: outputs of older runs are refused
FOOTER_KEY = b"wellmixed.shuffle"


# ---------------------------------------------------------------------------------------------------
# Global shuffle


@dataclass
class ShuffleSpec:
    """What to shuffle and how; every task of one run (any process, any array job) gets the same spec."""

    inputs: list[str]
    """Input parquet files, sorted: the file index (position here) seeds its scatter RNG."""
    out: str
    """Output directory: ``bucket-00000.parquet`` ... and ``shuffle_report.json``."""
    buckets: int = 200
    seed: int = 42
    tmp: Optional[str] = None
    """Directory for scatter parts and markers (default ``OUT/_shuffle_tmp``); needs about the
    corpus's size in free space while the run lasts."""
    source_column: str = "source"
    """Column whose shares per bucket are checked against the input's (Dolma3's sub-source)."""
    token_column: Optional[str] = "token_count"
    """Column summed for tokens per bucket (None or absent: not reported)."""
    text_column: str = "text"
    """Column hashed for the row checksum."""
    buffer_mb: float = 256.0
    """Decoded rows a scatter task keeps per flush (all buckets together)."""
    row_group_rows: int = 1024
    """Rows per row group of the output buckets."""
    compression: str = "zstd"

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("global shuffle: no input files")
        out = Path(self.out).resolve()
        inside = sorted({str(Path(p).resolve().parent) for p in self.inputs
                         if out == Path(p).resolve().parent or Path(p).resolve().parent in out.parents})
        if inside:
            raise ConfigError(f"--out {self.out} is inside the input folder {inside[0]}: the buckets would land "
                              "among the input shards (and be read as input by the next glob); choose a folder "
                              "outside every input folder")
        if not isinstance(self.buckets, int) or self.buckets < 1:
            raise ConfigError(f"--buckets must be a positive integer (got {self.buckets!r})")
        if self.row_group_rows < 1 or self.buffer_mb <= 0:
            raise ConfigError("--row-group-rows and --buffer-mb must be positive")

    @property
    def tmp_dir(self) -> Path:
        return Path(self.tmp) if self.tmp else Path(self.out) / "_shuffle_tmp"

    def output(self, bucket: int) -> Path:
        return Path(self.out) / f"bucket-{bucket:05d}.parquet"

    def identity(self) -> dict:
        """What makes two runs' files interchangeable; stored in every marker and output footer."""
        return {
            "version": SHUFFLE_VERSION,
            "seed": self.seed,
            "buckets": self.buckets,
            "inputs": inputs_fingerprint(self.inputs),
        }


def list_inputs(patterns: Iterable[str]) -> list[str]:
    """Files matching the globs (``~``, ``$VAR`` and ``**`` allowed), sorted, each file once: as the data path
    takes a source's files (data/source_files.py), every glob must match a file, globs meeting on a file or a
    symlinked folder give it once, under its first spelling, and a byte-identical copy is left out (named)."""
    matched = glob_each({"input glob": list(patterns)})["input glob"]
    spellings = sorted(set(files.first_spellings(sorted({p for found in matched.values() for p in found})).values()))
    copies = files.byte_copies(spellings)
    for copy, kept in copies.items():
        log.warning("%s has the same bytes as %s: scattered once, as %s", copy, kept, kept)
    return [p for p in spellings if p not in copies]


def inputs_fingerprint(paths: list[str]) -> str:
    """sha256 over (absolute path, size) of every input, in order: catches a glob that expanded
    differently in another array task, or a file that changed between the phases."""
    h = hashlib.sha256()
    for p in paths:
        h.update(f"{os.path.abspath(p)}|{os.path.getsize(p)}\n".encode())
    return h.hexdigest()[:16]


def reference_schema(spec: ShuffleSpec) -> pa.Schema:
    """The first input's schema: every input is cast to it, every output has it."""
    return pq.read_schema(spec.inputs[0])


def _check_columns(schema: pa.Schema, path: str, spec: ShuffleSpec) -> None:
    if spec.text_column not in schema.names:
        raise ConfigError(f"{path}: no text column {spec.text_column!r} (columns: {schema.names}); set --text-column")


def cast_to_schema(table: pa.Table, schema: pa.Schema, path: str) -> pa.Table:
    if table.schema.equals(schema, check_metadata=False):
        return table
    if table.column_names != schema.names:
        raise ConfigError(f"{path}: columns {table.column_names} differ from the first input's {schema.names}")
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ConfigError(f"{path}: cannot cast to the first input's schema: {e}") from None


def split_rows_by_label(table: pa.Table, labels: np.ndarray, n: int) -> list[Optional[pa.Table]]:
    """Split rows by integer label in [0, n): one stable sort, then zero-copy slices (None if empty)."""
    order = np.argsort(labels, kind="stable")
    ordered = table.take(pa.array(order))
    counts = np.bincount(labels, minlength=n)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [ordered.slice(int(s), int(c)) if c else None for s, c in zip(starts, counts)]


def _marker(spec: ShuffleSpec, index: int) -> Path:
    return spec.tmp_dir / f"f-{index:05d}.json"


def _read_marker(spec: ShuffleSpec, index: int) -> Optional[dict]:
    path = _marker(spec, index)
    if not path.is_file():
        return None
    marker = json.loads(path.read_text())
    if marker["identity"] != spec.identity():
        raise ConfigError(
            f"{path} belongs to another run ({marker['identity']}, this one is {spec.identity()}): "
            f"delete {spec.tmp_dir} or pass another --tmp"
        )
    return marker


def scatter_file(spec: ShuffleSpec, index: int) -> dict:
    """Scatter input file ``index`` into per-bucket parts; returns its marker (skips a finished task)."""
    marker = _read_marker(spec, index)
    if marker is not None:
        return {**marker, "skipped": True}
    path = spec.inputs[index]
    final, partial = _fresh_parts_folder(spec, index)
    schema = reference_schema(spec)
    rng = np.random.default_rng([spec.seed, 0, index])
    stats = RowStats()
    per_bucket = np.zeros(spec.buckets, dtype=np.int64)
    buffers: list[list[pa.Table]] = [[] for _ in range(spec.buckets)]
    buffered, flushes = 0, 0
    limit = spec.buffer_mb * 2**20

    def flush() -> None:
        nonlocal buffered, flushes
        for b, pieces in enumerate(buffers):
            if pieces:
                part = partial / f"b-{b:05d}-p{flushes:04d}.parquet"
                pq.write_table(pa.concat_tables(pieces), part, compression="lz4")
                pieces.clear()
        buffered, flushes = 0, flushes + 1

    pf = _open_input(path, spec)
    for rg in range(pf.num_row_groups):
        try:
            table = pf.read_row_group(rg)
        except Exception as e:
            raise ConfigError(f"{path}: row group {rg} unreadable (truncated or corrupt?): {e}") from None
        table = cast_to_schema(table, schema, path)
        stats.add_table(table, spec)
        assign = rng.integers(0, spec.buckets, size=table.num_rows)
        per_bucket += np.bincount(assign, minlength=spec.buckets)
        for b, piece in enumerate(split_rows_by_label(table, assign, spec.buckets)):
            if piece is not None:
                buffers[b].append(piece)
        buffered += table.nbytes
        if buffered >= limit:
            flush()
    flush()

    files.publish(partial, final)
    marker = {
        "identity": spec.identity(),
        "file": path,
        "stats": stats.to_dict(),
        "rows_per_bucket": per_bucket.tolist(),
        "flushes": flushes,
    }
    files.write_json(_marker(spec, index), marker)
    return {**marker, "skipped": False}


def _fresh_parts_folder(spec: ShuffleSpec, index: int) -> tuple[Path, Path]:
    """``(final, partial)`` folders of scatter task ``index``: leftovers of an interrupted task removed (never
    trusted, rebuilt), ``partial`` created empty; it is published as ``final`` once every part is in."""
    final = spec.tmp_dir / f"f-{index:05d}"
    partial = spec.tmp_dir / f"f-{index:05d}.partial"
    for leftover in (final, partial):
        shutil.rmtree(leftover, ignore_errors=True)
    partial.mkdir(parents=True)
    return final, partial


def _open_input(path: str, spec: ShuffleSpec) -> pq.ParquetFile:
    """An input file, refused by name when it is not parquet or lacks the columns the shuffle needs."""
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"{path}: not a readable parquet file: {e}") from None
    _check_columns(pf.schema_arrow, path, spec)
    return pf


def read_footer(path: Path) -> Optional[dict]:
    """The shuffle metadata in an output bucket's footer (None for a file without it); a bucket that is not a
    readable parquet file (truncated, damaged) is a ConfigError naming it."""
    try:
        meta = pq.read_metadata(path).metadata or {}
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(_damaged_bucket(path, e)) from None
    raw = meta.get(FOOTER_KEY)
    return json.loads(raw) if raw else None


def _damaged_bucket(path: Path, e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"{path}: not a readable bucket (truncated or damaged: {first}); delete it and rerun the same "
            "scripts/global_shuffle.py command (only that bucket is rebuilt)")


def bucket_done(spec: ShuffleSpec, bucket: int) -> bool:
    """True if the output exists and was written by this run (a foreign one is refused)."""
    path = spec.output(bucket)
    if not path.is_file():
        return False
    footer = read_footer(path)
    if footer is None or footer["identity"] != spec.identity():
        raise ConfigError(
            f"{path} exists but was not written by this run (seed/buckets/inputs differ, or not a shuffle "
            "output): use an empty --out"
        )
    return True


def gather_bucket(spec: ShuffleSpec, bucket: int) -> dict:
    """Read bucket ``bucket``'s parts in file order, permute, write it; returns its stats.

    Memory: the parts, then one contiguous copy of them (~2x the bucket for a moment), then 1x plus
    one output row group while the permutation is written a row group at a time. The statistics are
    taken from the row groups as they are written and go into the file's key-value metadata.
    """
    if bucket_done(spec, bucket):
        return {"bucket": bucket, "skipped": True, **read_footer(spec.output(bucket))}
    path = spec.output(bucket)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink()  # a killed earlier attempt at this bucket (one task owns a bucket at a time)
    schema = reference_schema(spec)
    pieces, expected = [], 0
    for index in range(len(spec.inputs)):
        marker = _read_marker(spec, index)
        if marker is None:
            raise ConfigError(f"gather: scatter task {index} ({spec.inputs[index]}) has not finished")
        expected += marker["rows_per_bucket"][bucket]
        for part in sorted((spec.tmp_dir / f"f-{index:05d}").glob(f"b-{bucket:05d}-p*.parquet")):
            pieces.append(pq.read_table(part))
    table = pa.concat_tables(pieces).combine_chunks() if pieces else schema.empty_table()
    del pieces
    if table.num_rows != expected:
        raise RuntimeError(f"bucket {bucket}: parts hold {table.num_rows} rows, the markers say {expected}")
    perm = np.random.default_rng([spec.seed, 1, bucket]).permutation(table.num_rows)
    stats = RowStats()
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(path, fsync=False) as tmp, \
            pq.ParquetWriter(tmp, schema, compression=spec.compression, **PAGE_OPTIONS) as writer:
        for start in range(0, table.num_rows, spec.row_group_rows):
            rows = table.take(pa.array(perm[start : start + spec.row_group_rows]))
            stats.add_table(rows, spec)
            writer.write_table(rows)
        footer = {"identity": spec.identity(), "bucket": bucket, "stats": stats.to_dict()}
        writer.add_key_value_metadata({FOOTER_KEY: json.dumps(footer).encode()})
    return {"bucket": bucket, "skipped": False, **footer}


def task_items(total: int, task_index: int, num_tasks: int) -> list[int]:
    """Items ``task_index, task_index + num_tasks, ...`` of ``range(total)``: one array task's share."""
    if not 0 <= task_index < num_tasks:
        raise ConfigError(f"--task-index {task_index} must be in [0, --num-tasks {num_tasks})")
    return list(range(task_index, total, num_tasks))


def _run(fn: Callable[[ShuffleSpec, int], dict], spec: ShuffleSpec, items: list[int], workers: int,
         progress: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """fn(spec, item) for every item: in this process, or in a pool of fresh (spawned) processes."""
    results = []
    if workers <= 1 or len(items) <= 1:
        for item in items:
            results.append(fn(spec, item))
            if progress:
                progress(results[-1])
        return results
    # spawn, not fork: workers start clean, so their RSS is their own (the benchmark reads it).
    with multiprocessing.get_context("spawn").Pool(min(workers, len(items))) as pool:
        for result in pool.imap_unordered(functools.partial(fn, spec), items):
            results.append(result)
            if progress:
                progress(result)
    return results


def scatter(spec: ShuffleSpec, task_index: int = 0, num_tasks: int = 1, workers: int = 1,
            progress: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Run this task's scatter share (input files ``task_index::num_tasks``)."""
    spec.tmp_dir.mkdir(parents=True, exist_ok=True)
    return _run(scatter_file, spec, task_items(len(spec.inputs), task_index, num_tasks), workers, progress)


def gather(spec: ShuffleSpec, task_index: int = 0, num_tasks: int = 1, workers: int = 1,
           buckets: Optional[list[int]] = None, progress: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Run this task's gather share (buckets ``task_index::num_tasks``, or the given ones)."""
    missing = [i for i in range(len(spec.inputs)) if _read_marker(spec, i) is None]
    if missing:
        raise ConfigError(
            f"gather: {len(missing)} of {len(spec.inputs)} scatter tasks have not finished "
            f"(files {missing[:10]}{' ...' if len(missing) > 10 else ''}): run the scatter phase first"
        )
    items = buckets if buckets is not None else task_items(spec.buckets, task_index, num_tasks)
    for b in items:
        bucket_done(spec, b)  # refuses another run's buckets before the record is touched
    drop_stale_report(spec)
    return _run(gather_bucket, spec, items, workers, progress)


def input_stats(spec: ShuffleSpec) -> Optional[RowStats]:
    """The input's statistics: from the scatter markers, or from this run's intact report."""
    markers = [_read_marker(spec, i) for i in range(len(spec.inputs))]
    if all(m is not None for m in markers):
        total = RowStats()
        for m in markers:
            total.merge(RowStats.from_dict(m["stats"]))
        return total
    report = _own_report(spec)
    return None if report is None else RowStats.from_dict(report["input"])


def _own_report(spec: ShuffleSpec) -> Optional[dict]:
    """This run's completion record in ``--out`` (None: none, unreadable, not a record, edited, another run's)."""
    try:
        report = json.loads((Path(spec.out) / REPORT).read_text())
    except (OSError, ValueError):
        return None
    return report if record_intact(report) and report.get("identity") == spec.identity() else None


def shuffle(spec: ShuffleSpec, workers: int = 1, keep_tmp: bool = False,
            progress: Optional[Callable[[str, dict], None]] = None) -> dict:
    """The whole run in this process (plus ``workers`` processes): scatter, gather, verify, clean up.

    A rerun skips what is done: only missing buckets are gathered, and the scatter phase runs again
    only when some bucket is missing and its parts were already cleaned up (or never made).
    """
    t0 = time.perf_counter()
    missing = [b for b in range(spec.buckets) if not bucket_done(spec, b)]  # refuses another run's buckets
    drop_stale_report(spec)
    scattered: list[dict] = []
    if missing or input_stats(spec) is None:
        scattered = scatter(spec, workers=workers, progress=_phase(progress, "scatter"))
    t1 = time.perf_counter()
    gathered = gather(spec, workers=workers, buckets=missing, progress=_phase(progress, "gather")) if missing else []
    t2 = time.perf_counter()
    report = verify(spec, written=[r["bucket"] for r in gathered if not r["skipped"]], workers=workers)
    report["run"] = _run_record(scattered, gathered, t1 - t0, t2 - t1, workers)
    write_report(spec, report)
    if report["ok"] and not keep_tmp:
        cleanup(spec)
    return report


def _run_record(scattered: list[dict], gathered: list[dict], scatter_s: float, gather_s: float, workers: int) -> dict:
    """What this invocation did (the report's ``run``): tasks run, buckets written, seconds per phase."""
    return {"scatter_tasks_run": sum(not r["skipped"] for r in scattered),
            "buckets_written": sorted(r["bucket"] for r in gathered if not r["skipped"]),
            "scatter_s": round(scatter_s, 3), "gather_s": round(gather_s, 3), "workers": workers}


def _phase(progress: Optional[Callable[[str, dict], None]], phase: str) -> Optional[Callable[[dict], None]]:
    return functools.partial(progress, phase) if progress else None


def verify(spec: ShuffleSpec, written: Iterable[int] = (), workers: int = 1) -> dict:
    """Compare the input's statistics with the outputs'. A bucket this invocation wrote (``written``) counts
    by the statistics its gather took from the rows as it wrote them (its footer); every other bucket is
    read again (``workers`` processes), its rows' statistics recomputed and compared with those written
    into its footer, so a bucket altered after it was written, footer carried over, is not re-blessed."""
    stats_in = input_stats(spec)
    if stats_in is None:
        raise ConfigError(f"verify: no scatter markers in {spec.tmp_dir} and no intact {REPORT} of this run in "
                          f"{spec.out}, so the input's statistics are unknown: rerun the same command without "
                          "--report-only (it re-reads the input and keeps the buckets)")
    absent = [b for b in range(spec.buckets) if not bucket_done(spec, b)]
    if absent:
        raise ConfigError(f"verify: {len(absent)} output bucket(s) missing, e.g. {spec.output(absent[0])}")
    problems = _extra_bucket_problems(spec)
    footers = [RowStats.from_dict(read_footer(spec.output(b))["stats"]) for b in range(spec.buckets)]
    per_bucket = list(footers)
    for r in _run(bucket_row_stats, spec, sorted(set(range(spec.buckets)) - set(written)), workers):
        per_bucket[r["bucket"]] = RowStats.from_dict(r["stats"])
    for b, (rows, footer) in enumerate(zip(per_bucket, footers)):
        if rows.to_dict() != footer.to_dict() or pq.read_metadata(spec.output(b)).num_rows != footer.rows:
            problems.append(f"{spec.output(b)}: its rows ({rows.rows}, checksum {rows.checksum:016x}) are not "
                            f"those written ({footer.rows}, checksum {footer.checksum:016x}): it was altered after "
                            "it was written; delete it and rerun the same command (only it is rebuilt)")
    stats_out = RowStats()
    for s in per_bucket:
        stats_out.merge(s)
    shares = source_share_check(stats_in, per_bucket)
    problems += _stats_problems(stats_in, stats_out, shares)

    sizes = [spec.output(b).stat().st_size for b in range(spec.buckets)]
    return {
        "identity": spec.identity(),
        "ok": not problems,
        "problems": problems,
        "files_in": len(spec.inputs),
        "buckets": spec.buckets,
        "rows_in": stats_in.rows,
        "rows_out": stats_out.rows,
        "checksum_in": f"{stats_in.checksum:016x}",
        "checksum_out": f"{stats_out.checksum:016x}",
        "tokens_in": stats_in.tokens,
        "tokens_out": stats_out.tokens,
        "source_shares": shares,
        "rows_per_bucket": _spread([s.rows for s in per_bucket]),
        "tokens_per_bucket": _spread([s.tokens for s in per_bucket]),
        "bytes_per_bucket": _spread(sizes),
        "bucket_files": {spec.output(b).name: [s.rows, files.file_digest(spec.output(b))]  # data/shuffled.py
                         for b, s in enumerate(per_bucket)},
        "input": stats_in.to_dict(),
    }


def _extra_bucket_problems(spec: ShuffleSpec) -> list[str]:
    """Bucket files in the output folder beyond this run's ``--buckets`` (or not numbered)."""
    extra = sorted(p.name for p in Path(spec.out).glob("bucket-*.parquet")
                   if not p.stem[len("bucket-"):].isdigit() or int(p.stem[len("bucket-"):]) >= spec.buckets)
    if not extra:
        return []
    return [f"{len(extra)} bucket file(s) beyond --buckets {spec.buckets} (from another run?): {extra[:5]}"]


def bucket_row_stats(spec: ShuffleSpec, bucket: int) -> dict:
    """Output bucket ``bucket``'s statistics read from its rows, a row group at a time (not its footer)."""
    path = spec.output(bucket)
    stats = RowStats()
    try:
        pf = pq.ParquetFile(path)
        cols = [c for c in (spec.text_column, spec.source_column, spec.token_column) if c in pf.schema_arrow.names]
        for i in range(pf.num_row_groups):
            stats.add_table(pf.read_row_group(i, columns=cols), spec)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(_damaged_bucket(path, e)) from None
    return {"bucket": bucket, "stats": stats.to_dict()}


def _stats_problems(stats_in: RowStats, stats_out: RowStats, shares: dict) -> list[str]:
    """Input against output: rows, text checksum, rows per source, and the per-bucket source shares."""
    problems = []
    if stats_out.rows != stats_in.rows:
        problems.append(f"rows: {stats_in.rows} in, {stats_out.rows} out")
    if stats_out.checksum != stats_in.checksum:
        problems.append("text checksum differs: rows were lost, duplicated or altered")
    src_rows_in = {k: v[0] for k, v in stats_in.sources.items()}
    src_rows_out = {k: v[0] for k, v in stats_out.sources.items()}
    if src_rows_in != src_rows_out:
        problems.append("rows per source differ between input and output")
    if shares.get("untested"):
        problems.append(shares["untested"])
    elif not shares["within_sampling_error"]:
        w = shares["worst"]
        problems.append(f"bucket {w['bucket']} source {w['source']}: {w['z']:+.1f} sigma from a uniform assignment")
    return problems


def _spread(values: list[int]) -> dict:
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}


def drop_stale_report(spec: ShuffleSpec) -> None:
    """Remove a completion record that is not this run's intact one (other inputs, seed or buckets; edited; not
    a record) before writing any bucket: until this run's own report is written, readers then see the folder
    as incomplete."""
    path = Path(spec.out) / REPORT
    if path.exists() and _own_report(spec) is None:
        path.unlink()


def write_report(spec: ShuffleSpec, report: dict) -> Path:
    path = Path(spec.out) / REPORT
    files.write_json(path, {**report, "record_sha256": record_checksum(report)})  # data/shuffled.py
    return path


def cleanup(spec: ShuffleSpec) -> None:
    """Remove this tool's scatter parts and markers (only its own names: --tmp may be shared)."""
    tmp = spec.tmp_dir
    if not tmp.is_dir():
        return
    for entry in tmp.iterdir():
        if entry.name.startswith("f-") and entry.is_dir():
            shutil.rmtree(entry)
        elif entry.name.startswith("f-") and entry.suffix == ".json":
            entry.unlink()
    try:
        tmp.rmdir()
    except OSError:  # other files in a shared --tmp
        pass


def format_report(report: dict) -> str:
    """The report as a few printed lines."""
    s = report["source_shares"]
    r, t, by = report["rows_per_bucket"], report["tokens_per_bucket"], report["bytes_per_bucket"]
    lines = [
        f"rows      in {report['rows_in']:,}  out {report['rows_out']:,}  "
        f"{'equal' if report['rows_in'] == report['rows_out'] else 'DIFFERENT'}",
        f"checksum  in {report['checksum_in']}  out {report['checksum_out']}  "
        f"{'equal' if report['checksum_in'] == report['checksum_out'] else 'DIFFERENT'}",
        f"tokens    in {report['tokens_in']:,}  out {report['tokens_out']:,}",
        f"buckets   {report['buckets']}: rows min/mean/max {r['min']:,}/{r['mean']:,}/{r['max']:,}; "
        f"tokens {t['min']:,}/{t['mean']:,}/{t['max']:,}; bytes {by['min']:,}/{by['mean']:,}/{by['max']:,}",
        f"sources   max |share - input share| rows {s['max_abs_share_dev_rows']:.4f}, tokens "
        f"{s['max_abs_share_dev_tokens']:.4f}; max |z| {s['max_abs_z']:.2f} over {s['cells_tested']} "
        f"(bucket, source) cells (limit {s['z_limit']:.2f}, {s['cells_too_small']} cells with < 5 expected "
        f"rows not tested): {'within' if s['within_sampling_error'] else 'OUTSIDE'} sampling error",
    ]
    if "run" in report:
        run = report["run"]
        lines.append(
            f"run       scatter tasks run {run['scatter_tasks_run']}, buckets written {len(run['buckets_written'])}, "
            f"scatter {run['scatter_s']:.2f}s, gather {run['gather_s']:.2f}s, workers {run['workers']}"
        )
    lines.append("OK" if report["ok"] else "FAILED: " + "; ".join(report["problems"]))
    return "\n".join(lines)
