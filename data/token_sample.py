"""``token_count`` against the text: a fixed sample of each source's documents counted with ``data.tokenizer``.

The column sizes every plan, epoch and hold-out, so the manifest does not trust it blindly. Per source,
documents chosen with a seed from the source's name -- up to :data:`SAMPLE_ROWS` row groups of its
training chunks, one document each (more per group when it has fewer), each among the first
:data:`SAMPLE_SCAN_ROWS` rows of its row group, so the cost is a few small reads whatever the row-group
size -- are tokenized with the configured tokenizer. The whole sample and each file's part of it must be
within :data:`TOKEN_COUNT_RATIO` of that count (differences of at most :data:`SAMPLE_ROWS` tokens, one per
document, give no verdict: an EOT counted in the column). The column counted with the same tokenizer
matches exactly; x0.95..x1.05 refuses a column counted with a near tokenizer (another BPE of about the
same size, whose counts differ by 10-30%: every plan and epoch would be off by that much) and a x100 or
/1000 column alike, naming its file. A sampled text that is not valid UTF-8 is named by file and row; a
sampled row group that cannot be read is named here, before compute, rather than by a DataLoader worker
hours later. The manifest caches each source's outcome by its files' cache keys and the tokenizer.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.config import FilterConfig
from data.errors import ConfigError
from data.mapping import matches
from data.tokenizer import Tokenizer

SAMPLE_ROWS = 16  # documents per source whose token_count is compared with the tokenizer's real count
TOKEN_COUNT_RATIO = (0.95, 1.05)  # allowed token_count / real count over a source's sample
SAMPLE_SCAN_ROWS = 256  # rows read from the start of a sampled row group (never the whole group)

Group = tuple[str, int, int]  # (path, row group, its first row)


def sample_token_counts(name: str, groups: list[Group], filt: FilterConfig | None, text_column: str,
                        tokenizer: Tokenizer) -> dict:
    """The sample's verdict over the source's row groups ``groups`` (sorted by path, then row group):
    ``{"problem": str | None, "rows", "counted", "real"}`` (cached by the manifest)."""
    per_file: dict[str, list[int]] = {}  # path -> [rows, token_count sum, real count]
    unreadable: list[str] = []
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    picked = sorted(groups[i] for i in rng.permutation(len(groups))[:SAMPLE_ROWS])
    cols = [text_column, "token_count"] + ([filt.column] if filt else [])
    per_group = -(-SAMPLE_ROWS // max(1, len(picked)))
    for path, rg, first in picked:
        try:
            table = _first_rows(path, rg, cols, filt)
        except Exception as e:  # noqa: BLE001 -- a corrupt page (ArrowInvalid, OSError, ...)
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            unreadable.append(f"{path}: row group {rg}: unreadable ({reason}; met by the start-up token_count "
                              f"sample of data.sources.{name}); restore or rewrite the file, or remove it from the "
                              "corpus")
            continue
        if table.num_rows:
            rows = sorted(rng.permutation(table.num_rows)[:per_group].tolist())
            acc = per_file.setdefault(path, [0, 0, 0])  # [rows, token_count sum, real count]
            acc[0] += len(rows)
            acc[1] += sum(table.column("token_count").take(rows).to_pylist())
            acc[2] += sum(tokenizer.count(_texts(table.column(text_column), rows, path, first, text_column), 1))
    n, counted, real = _totals(per_file)
    problem = "; ".join(filter(None, [_token_count_problem(name, per_file, text_column, tokenizer), *unreadable]))
    return {"problem": problem or None, "rows": n, "counted": counted, "real": real}


def _first_rows(path: str, rg: int, cols: list[str], filt: FilterConfig | None) -> pa.Table:
    """The first :data:`SAMPLE_SCAN_ROWS` rows of row group ``rg`` that the filter keeps."""
    pf = pq.ParquetFile(path, buffer_size=1 << 20)
    batch = next(pf.iter_batches(batch_size=SAMPLE_SCAN_ROWS, row_groups=[rg], columns=cols), None)
    table = pa.Table.from_batches([batch]) if batch is not None else pa.table({c: [] for c in cols})
    return table.filter(matches(table.column(filt.column), filt.patterns)) if filt and table.num_rows else table


def _texts(column: pa.ChunkedArray, rows: list[int], path: str, first: int, text_column: str) -> list[str]:
    """The sampled texts (null as empty); a text that is not valid UTF-8 is named by file and row."""
    out = []
    for row, value in zip(rows, column.take(rows).cast(pa.large_binary()).to_pylist()):
        try:
            out.append((value or b"").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: row {first + row}: column '{text_column}' is not valid "
                              f"UTF-8 ({e.reason} at byte {e.start}); fix or re-encode the file") from None
    return out


def _totals(per_file: dict[str, list[int]]) -> tuple[int, int, int]:
    """Rows, token_count sum and real count over the whole sample."""
    n, counted, real = (sum(v[i] for v in per_file.values()) for i in range(3))
    return n, counted, real


def _off(counted: int, real: int) -> bool:
    """Outside the allowed ratio (a difference of a few tokens gives no verdict)."""
    lo, hi = TOKEN_COUNT_RATIO
    return not lo * real <= counted <= hi * real and abs(counted - real) > SAMPLE_ROWS


def _ratio(v: list[int]) -> float:
    return v[1] / v[2] if v[2] else math.inf


def _token_count_problem(name: str, per_file: dict[str, list[int]], text_column: str,
                         tokenizer: Tokenizer) -> str | None:
    """The verdict on a sample (per file ``[rows, counted, real]``): None, or the problem naming the worst files."""
    n, counted, real = _totals(per_file)
    if n and real == 0 and counted > 0:  # token_count 0 as well: the source-wide check names it
        return _empty_texts(name, per_file, text_column, n, counted)
    # the source's sample as a whole, and each file's share of it (one bad file among many good ones)
    bad_files = [(p, v) for p, v in per_file.items() if _off(v[1], v[2])]
    if not bad_files and not _off(counted, real):
        return None
    lo, hi = TOKEN_COUNT_RATIO
    return (f"data.sources.{name}: token_count does not match the text ({_worst(bad_files, per_file)}); the sample "
            f"of {n} row(s) must be within x{lo:g}..x{hi:g} of its count with data.tokenizer ({tokenizer.name}): a "
            "column counted with another tokenizer is recounted at start-up with data.tokenizer.recount true (reads "
            "every text once, cached), else fix the column")


def _empty_texts(name: str, per_file: dict[str, list[int]], text_column: str, n: int, counted: int) -> str:
    return (f"data.sources.{name}: all {n} sampled document(s) have an empty `{text_column}` (in "
            f"{', '.join(sorted(per_file))}; token_count sums to {counted:,} over them); the source "
            "would train on EOT tokens only: fix its files, data.text_column, or drop the source")


def _worst(bad_files: list[tuple[str, list[int]]], per_file: dict[str, list[int]]) -> str:
    """The three bad files (or, when only the whole sample is off, files) whose ratio is furthest from 1."""
    worst = sorted(bad_files or per_file.items(), key=lambda kv: abs(math.log(_ratio(kv[1]) or 1e-9)), reverse=True)
    return "; ".join(f"{p}: token_count {v[1]:,} vs {v[2]:,} real over {v[0]} sampled row(s) (x{_ratio(v):.3g})"
                     for p, v in worst[:3])
