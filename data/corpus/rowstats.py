"""What a set of rows is, for checking a global shuffle: rows, an order-independent text checksum, rows and
tokens per source (:class:`RowStats`, added up over row groups, files and buckets), and each bucket's
source shares against the sampling error of a uniform assignment (:func:`source_share_check`)."""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from data.corpus.shuffle import ShuffleSpec

_MASK64 = (1 << 64) - 1


def text_hashes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64-bit BLAKE2b of each value's UTF-8 bytes (uint64 [rows]); nulls get a fixed distinct hash."""
    if isinstance(column, pa.ChunkedArray):  # per chunk: no combined copy of the texts
        return np.concatenate([text_hashes(c) for c in column.chunks] or [np.zeros(0, dtype=np.uint64)])
    arr = column.cast(pa.large_binary())
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[arr.offset : arr.offset + n + 1]
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    blake = functools.partial(hashlib.blake2b, digest_size=8)
    digests = b"".join(blake(data[offsets[i] : offsets[i + 1]]).digest() for i in range(n))
    out = np.frombuffer(digests, dtype="<u8").astype(np.uint64)
    if arr.null_count:
        out[arr.is_null().to_numpy(zero_copy_only=False)] = np.uint64(0x6E756C6C)  # "null"
    return out


@dataclass
class RowStats:
    """Rows, checksum and per-source (rows, tokens) of a set of rows; adding two sets adds these."""

    rows: int = 0
    checksum: int = 0  # sum mod 2^64 of text_hashes: order-independent, sensitive to loss and duplication
    tokens: int = 0
    sources: dict[str, list[int]] = field(default_factory=dict)  # source value -> [rows, tokens]

    def add_table(self, table: pa.Table, spec: ShuffleSpec) -> None:
        self.rows += table.num_rows
        self.checksum = (
            self.checksum + int(text_hashes(table.column(spec.text_column)).sum(dtype=np.uint64))
        ) & _MASK64
        has_tokens = spec.token_column is not None and spec.token_column in table.column_names
        if has_tokens:
            tok = table.column(spec.token_column).to_numpy(zero_copy_only=False)
            self.tokens += int(np.nansum(tok))
        if spec.source_column not in table.column_names or table.num_rows == 0:
            return
        aggs = [(spec.source_column, "count", pc.CountOptions(mode="all"))]
        if has_tokens:
            aggs.append((spec.token_column, "sum"))
        grouped = table.group_by(spec.source_column).aggregate(aggs).to_pydict()
        counts = grouped[f"{spec.source_column}_count"]
        sums = grouped[f"{spec.token_column}_sum"] if has_tokens else [0] * len(counts)
        for value, rows, tokens in zip(grouped[spec.source_column], counts, sums):
            key = "<null>" if value is None else str(value)
            entry = self.sources.setdefault(key, [0, 0])
            entry[0] += int(rows)
            entry[1] += int(tokens or 0)

    def merge(self, other: "RowStats") -> None:
        self.rows += other.rows
        self.checksum = (self.checksum + other.checksum) & _MASK64
        self.tokens += other.tokens
        for key, (rows, tokens) in other.sources.items():
            entry = self.sources.setdefault(key, [0, 0])
            entry[0] += rows
            entry[1] += tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "checksum": f"{self.checksum:016x}"}

    @classmethod
    def from_dict(cls, d: dict) -> "RowStats":
        return cls(d["rows"], int(d["checksum"], 16), d["tokens"], {k: list(v) for k, v in d["sources"].items()})


def source_share_check(stats_in: RowStats, per_bucket: list[RowStats], min_expected: float = 5.0) -> dict:
    """Each bucket's rows per source against a uniform assignment.

    Under the shuffle, the rows of source s in bucket b are Binomial(N_s, 1/B): mean N_s/B, variance
    N_s (1/B)(1 - 1/B). Cells with an expected count below ``min_expected`` are left out of the test
    (the normal approximation fails there) and counted. The limit is 4 sigma, raised to the Bonferroni
    bound for a 1% false-alarm rate over all tested cells when there are many (about 4.8 sigma for
    200 buckets x 30 sub-sources). Share deviations (rows and tokens, in absolute share points) are
    reported for every cell.

    With more than one bucket and no cell large enough to test, the check could not fail: it fails
    (``untested`` says why and what to do) instead of passing with 0 cells. One bucket has nothing to
    test (its shares are the input's by construction) and passes.
    """
    B = len(per_bucket)
    tested, skipped = _testable_cells(stats_in, per_bucket, min_expected)
    worst = _worst_cell(tested)
    limit = max(4.0, statistics.NormalDist().inv_cdf(1 - 0.01 / (2 * len(tested)))) if tested else 4.0
    untested = _untested(stats_in, B, skipped, min_expected) if not tested and B > 1 else None
    row_dev, tok_dev = _share_deviations(stats_in, per_bucket)
    return {
        "untested": untested,
        "max_abs_share_dev_rows": round(row_dev, 6),
        "max_abs_share_dev_tokens": round(tok_dev, 6),
        "max_abs_z": abs(worst["z"]) if worst else 0.0,
        "z_limit": round(limit, 3),
        "cells_tested": len(tested),
        "cells_too_small": skipped,
        "within_sampling_error": untested is None and (worst is None or abs(worst["z"]) <= limit),
        "worst": worst,
    }


def _testable_cells(stats_in: RowStats, per_bucket: list[RowStats],
                    min_expected: float) -> tuple[list[tuple[float, dict]], int]:
    """The (bucket, source) cells expecting at least ``min_expected`` rows, with their z-scores; the others' count."""
    B = len(per_bucket)
    p = 1.0 / B
    tested, skipped = [], 0
    for b, s in enumerate(per_bucket):
        for name, (n_src, _) in stats_in.sources.items():
            mean = n_src * p
            if mean < min_expected or B == 1:
                skipped += 1
                continue
            got = s.sources.get(name, [0, 0])[0]
            z = (got - mean) / math.sqrt(n_src * p * (1 - p))
            tested.append((z, {"bucket": b, "source": name, "rows": got, "expected": round(mean, 2), "z": round(z, 3)}))
    return tested, skipped


def _worst_cell(tested: list[tuple[float, dict]]) -> dict | None:
    """The cell furthest from its mean: a later cell replaces it when above its z as reported (rounded)."""
    worst = None
    for z, cell in tested:
        if worst is None or abs(z) > abs(worst["z"]):
            worst = cell
    return worst


def _share_deviations(stats_in: RowStats, per_bucket: list[RowStats]) -> tuple[float, float]:
    """The largest |bucket share - input share| of any source, in rows and in tokens."""
    row_dev = tok_dev = 0.0
    for s in per_bucket:
        for name, (n_src, t_src) in stats_in.sources.items():
            got_rows, got_tokens = s.sources.get(name, [0, 0])
            if s.rows:
                row_dev = max(row_dev, abs(got_rows / s.rows - n_src / (stats_in.rows or 1)))
            if s.tokens:
                tok_dev = max(tok_dev, abs(got_tokens / s.tokens - t_src / (stats_in.tokens or 1)))
    return row_dev, tok_dev


def _untested(stats_in: RowStats, buckets: int, skipped: int, min_expected: float) -> str:
    largest = max((n for n, _ in stats_in.sources.values()), default=0)
    return (f"source shares untested: no (bucket, source) cell expects >= {min_expected:g} rows ({skipped} "
            f"too small: {buckets} buckets for {stats_in.rows:,} rows), so a clustered output would pass; use at "
            f"most {max(1, int(largest // min_expected))} --buckets (the largest source has {largest:,} rows) or "
            "check a larger corpus")
