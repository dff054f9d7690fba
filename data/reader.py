"""Reading documents by address: chunks streamed in bounded slices, single rows by address.

A chunk is a row range inside one parquet row group, and a row group can hold ~100k documents
(Dolma3-style files, ~800M tokens): tokenizing a whole chunk on open cost minutes and gigabytes per
consumer. So a chunk is read *lazily*: :class:`LazyChunk` knows which of its rows are documents (the
filter column, small, and the text column's null count from the footer), and decodes ``SLICE_ROWS``
rows at a time as the stream consumes them, in row order. Memory per open chunk is one slice of text
(plus the parquet decoder's page buffers), whatever the row-group size; resuming inside a chunk
decodes the rows before its position. Nothing is tokenized here: the stream tokenizes a document when
it leaves the shuffle buffer (data/stream.py), so filling a buffer or restoring one
(:meth:`ShardReader.read_texts`, each row group scanned once in the same slices) costs decoding only.

A buffered document is held as its UTF-8 bytes, zstd-compressed straight from Arrow's buffer
(:class:`HeldText`; never a Python ``str``, which takes 1-4 bytes per character): a buffer of 10,000
Dolma3-length documents per source is the largest thing a consumer holds, and this holds it in
about a third of the memory, at 0.89x the steady tokens/s and a slower restore (docs/benchmarks.md). Files are opened
without pre-buffering, which would hold each open chunk's whole compressed column chunk.

A null ``text`` is named ``file:row group:row``; with ``data.on_bad_shard: skip`` it is left out
(logged and counted in ``ShardReader.bad_rows``), the same rows on every read, so the document
counts a cursor relies on do not change between a run and its resume. Text that cannot be decoded is
always an error naming the row. Every read failure (a file that will not open, a corrupt page, a row
missing) is a ``data.errors.DataError`` naming ``file: row group`` and the way out: the entry points
print it as one ``error:`` line (exit 2).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict, deque
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.config import DataConfig
from data.errors import DataError
from data.manifest import Chunk, Manifest, matches

log = logging.getLogger(__name__)

SLICE_ROWS = 256
"""Rows decoded and tokenized at a time: an open chunk's read-ahead (and a restore's)."""
READ_BUFFER = 1 << 20
"""Bytes of a column chunk read at a time, so a slice does not pull in the whole row group."""


class HeldText(NamedTuple):
    """A document's text while it waits in a buffer: its UTF-8 bytes, zstd-compressed."""

    size: int  # UTF-8 bytes
    data: bytes

    @staticmethod
    def of(utf8: pa.Buffer | bytes) -> "HeldText":
        return HeldText(len(utf8), pa.compress(utf8, HELD_CODEC, asbytes=True) if HELD_CODEC else bytes(utf8))

    def text(self) -> str:
        raw = pa.decompress(self.data, self.size, HELD_CODEC, asbytes=True) if HELD_CODEC else self.data
        return raw.decode("utf-8")  # validated when read (ShardReader._texts_of_rows)


HELD_CODEC = "zstd" if pa.Codec.is_available("zstd") else None
"""How buffered texts are compressed (level 1: ~200 MB/s in, ~400 MB/s out, 2.7-2.9x on the demo's text)."""


class ShardReader:
    def __init__(self, manifest: Manifest, cfg: DataConfig, max_open_files: int = 32):
        self.manifest = manifest
        self.text_column = cfg.text_column
        self.tokenizer, self.threads = cfg.tokenizer.build(), cfg.tokenizer_threads
        self.skip_bad = cfg.on_bad_shard == "skip"
        self.filters = [info.filter for info in manifest.sources.values()]
        self._files: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._max_open = max_open_files
        self.bad_rows: dict[tuple[int, int], list[int]] = {}  # (shard, row group) -> rows skipped (null text)

    def _file(self, shard: int) -> pq.ParquetFile:
        pf = self._files.pop(shard, None)
        if pf is None:
            try:
                pf = pq.ParquetFile(self.manifest.shards[shard].path, buffer_size=READ_BUFFER,
                                    pre_buffer=False)  # pre-buffering holds whole column chunks
            except Exception as e:
                raise DataError(f"{self.manifest.shards[shard].path}: cannot open parquet file: {_first_line(e)}; "
                                f"{REBUILD}") from e
            if len(self._files) >= self._max_open:
                self._files.popitem(last=False)
        self._files[shard] = pf
        return pf

    def _row_group(self, shard: int, row: int) -> tuple[int, int]:
        for i, (first, n) in enumerate(self.manifest.shards[shard].row_groups):
            if first <= row < first + n:
                return i, first
        raise DataError(f"{self.manifest.shards[shard].path}: row {row} out of range (file changed since the "
                        f"manifest was built?); {REBUILD}")

    def _where(self, shard: int, rg: int, row: int | None = None) -> str:
        """``file:row group:row`` (or ``file: row group N`` for a whole row group)."""
        path = self.manifest.shards[shard].path
        return f"{path}: row group {rg}" if row is None else f"{path}:{rg}:{row}"

    def _read(self, source: int, shard: int, rg: int, columns: list[str]) -> pa.Table:
        """Whole columns of one row group (used for the small filter column only)."""
        try:
            return self._file(shard).read_row_group(rg, columns=columns)
        except Exception as e:
            raise DataError(f"{self._where(shard, rg)}: column(s) {columns} unreadable (file changed or corrupt "
                            f"since the manifest was built?): {_first_line(e)}; {REBUILD}") from e

    def _scan(self, shard: int, rg: int) -> Iterator[pa.Array]:
        """The text column of one row group, SLICE_ROWS rows at a time."""
        try:
            batches = self._file(shard).iter_batches(batch_size=SLICE_ROWS, row_groups=[rg],
                                                     columns=[self.text_column], use_threads=False)
            for batch in batches:
                yield batch.column(0)
        except Exception as e:
            raise DataError(f"{self._where(shard, rg)}: `{self.text_column}` unreadable (file changed or corrupt "
                            f"since the manifest was built?): {_first_line(e)}; {REBUILD}") from e

    def _read_slice(self, scan: Iterator[pa.Array]) -> pa.Array | None:
        """The next slice of a scan (None at its end); one place to time parquet reads."""
        return next(scan, None)

    # -- which rows are documents ----------------------------------------------------------------
    def valid_rows(self, source: int, chunk: Chunk) -> np.ndarray:
        """Rows of the chunk that are documents of the source: the row filter applied, null texts
        refused (or, with ``on_bad_shard: skip``, left out and counted)."""
        rg, first = self._row_group(chunk.shard, chunk.start)
        rows = np.arange(chunk.start, chunk.stop)
        keep = np.ones(len(rows), dtype=bool)
        filt = self.filters[source]
        if filt:
            col = self._read(source, chunk.shard, rg, [filt.column]).column(0)
            col = col.slice(chunk.start - first, chunk.stop - chunk.start)
            keep &= matches(col, filt.patterns).to_numpy(zero_copy_only=False)
        if self._may_hold_nulls(chunk.shard, rg):
            nulls = self._null_rows(chunk.shard, rg, first)
            bad = [r for r in rows[keep] if r in nulls]
            if bad:
                self._bad_text(chunk.shard, rg, bad)
                keep &= ~np.isin(rows, bad)
        return rows[keep]

    def _may_hold_nulls(self, shard: int, rg: int) -> bool:
        """From the footer: a text column chunk whose statistics count no nulls needs no scan."""
        meta = self._file(shard).metadata.row_group(rg)
        for i in range(meta.num_columns):
            col = meta.column(i)
            if col.path_in_schema == self.text_column:
                stats = col.statistics
                return stats is None or not stats.has_null_count or stats.null_count > 0
        return True

    def _null_rows(self, shard: int, rg: int, first: int) -> set[int]:
        """Rows of a row group whose text is null (one decoding pass, nothing tokenized)."""
        out, pos = set(), first
        scan = self._scan(shard, rg)
        while (col := self._read_slice(scan)) is not None:
            out |= {pos + int(i) for i in np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))}
            pos += len(col)
        return out

    def _bad_text(self, shard: int, rg: int, rows: list[int]) -> None:
        where = ", ".join(self._where(shard, rg, int(r)) for r in rows[:5]) + (" ..." if len(rows) > 5 else "")
        if not self.skip_bad:
            raise DataError(f"{len(rows)} document(s) with a null `{self.text_column}`: {where}; fix the file, or "
                              "set data.on_bad_shard: skip to leave such rows out (logged and counted)")
        if (shard, rg) not in self.bad_rows:
            log.warning("skipping %d row(s) with a null text: %s", len(rows), where)
        self.bad_rows[(shard, rg)] = sorted({*self.bad_rows.get((shard, rg), []), *map(int, rows)})

    # -- reading --------------------------------------------------------------------------------
    def open_chunk(self, source: int, chunk: Chunk, skip: int = 0) -> "LazyChunk":
        """The chunk's documents minus the first ``skip``, read lazily (nothing is tokenized yet)."""
        return LazyChunk(self, chunk, self.valid_rows(source, chunk)[skip:])

    def read_chunk(self, source: int, chunk: Chunk, skip: int = 0) -> tuple[list[int], list[np.ndarray]]:
        """All of a chunk's documents at once (the held-out set; tests): rows and tokens."""
        lazy = self.open_chunk(source, chunk, skip)
        docs = [lazy.take() for _ in range(lazy.left)]
        return [r for r, _ in docs], self.tokenizer.encode_docs([t.text() for _, t in docs], self.threads)

    def read_docs(self, source: int, addrs: list[tuple[int, int]]) -> list[np.ndarray]:
        """Tokens of documents given as (shard, row), in the given order (see :meth:`read_texts`)."""
        return self.tokenizer.encode_docs([t.text() for t in self.read_texts(source, addrs)], self.threads)

    def read_texts(self, source: int, addrs: list[tuple[int, int]]) -> list[HeldText]:
        """Texts of documents given as (shard, row), in the given order; each row group they touch is
        scanned once in bounded slices."""
        by_group: dict[tuple[int, int, int], set[int]] = defaultdict(set)
        for shard, row in addrs:
            rg, first = self._row_group(shard, row)
            by_group[(shard, rg, first)].add(row)
        texts: dict[tuple[int, int], HeldText] = {}
        for (shard, rg, first), rows in by_group.items():
            wanted = np.array(sorted(rows))
            for row, text in zip(wanted, self._texts_of_rows(shard, rg, wanted, self._scan(shard, rg), [first])):
                texts[(shard, int(row))] = text
        return [texts[(shard, row)] for shard, row in addrs]

    def encode(self, held: HeldText) -> np.ndarray:
        """One document's tokens, EOT last (the stream tokenizes a document when it leaves the buffer)."""
        return self.tokenizer.encode_docs([held.text()], self.threads)[0]

    def _texts_of_rows(self, shard: int, rg: int, rows: np.ndarray, scan: Iterator[pa.Array],
                       state: list) -> list[HeldText]:
        """Texts of ``rows`` (ascending, at or after the scan's position) read from ``scan``.

        ``state`` is ``[first row of the current slice, current slice or None]``, carried between calls
        so a lazy chunk keeps its place in the row group.
        """
        texts: list[HeldText] = []
        for row in rows:
            while len(state) < 2 or state[1] is None or row >= state[0] + len(state[1]):
                if len(state) == 2 and state[1] is not None:
                    state[0] += len(state[1])
                nxt = self._read_slice(scan)
                if nxt is None:
                    raise DataError(f"{self._where(shard, rg, int(row))}: row missing (file changed since the "
                                    f"manifest was built?); {REBUILD}")
                self._check_utf8(nxt, shard, rg, state[0])
                state[1:] = [nxt]
            texts.append(self._text(state[1], int(row) - state[0], shard, rg, int(row)))
        return texts

    def _check_utf8(self, col: pa.Array, shard: int, rg: int, first: int) -> None:
        """A slice's texts are valid UTF-8 (one vectorized pass), or the first bad row is named."""
        try:
            col.validate(full=True)
        except pa.ArrowInvalid as e:
            bad = next((i for i in range(len(col)) if not _utf8(col[i])), None)
            where = self._where(shard, rg) if bad is None else self._where(shard, rg, first + bad)
            raise DataError(f"{where}: `{self.text_column}` cannot be decoded ({_first_line(e)}); write the text "
                            "as UTF-8 (parquet does not check it), or remove the file from the corpus") from e

    def _text(self, col: pa.Array, i: int, shard: int, rg: int, row: int) -> HeldText:
        value = col[i]
        if not value.is_valid:  # the footer's null count said none (or the file changed): always an error here
            raise DataError(f"{self._where(shard, rg, row)}: `{self.text_column}` is null (the footer counted no "
                            f"nulls: file changed since the manifest was built?); {REBUILD}")
        return HeldText.of(value.as_buffer())


REBUILD = "restore or rewrite the file, or remove it from the corpus (the manifest is rebuilt at the next start)"
"""The way out of an unreadable corpus file."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _utf8(value: pa.Scalar) -> bool:
    try:
        value.as_py()
        return True
    except ValueError:  # UnicodeDecodeError included
        return False


class LazyChunk:
    """A chunk's documents in row order, decoded SLICE_ROWS rows at a time (held texts; tokenized later)."""

    def __init__(self, reader: ShardReader, chunk: Chunk, rows: np.ndarray):
        self.reader, self.shard = reader, chunk.shard
        self.rg, first = reader._row_group(chunk.shard, chunk.start)
        self.rows, self.pos = rows, 0
        self.ready: deque[tuple[int, HeldText]] = deque()
        self._scan: Iterator[pa.Array] | None = None
        self._state: list = [first]

    @property
    def left(self) -> int:
        """Documents not taken yet."""
        return len(self.rows) - self.pos

    def take(self) -> tuple[int, HeldText]:
        """(row, text) of the next document."""
        if not self.ready:
            self._read_ahead()
        self.pos += 1
        return self.ready.popleft()

    def _read_ahead(self) -> None:
        if self._scan is None:
            self._scan = self.reader._scan(self.shard, self.rg)
        start = self.pos + len(self.ready)
        rows = self.rows[start:start + SLICE_ROWS]
        texts = self.reader._texts_of_rows(self.shard, self.rg, rows, self._scan, self._state)
        self.ready.extend(zip(rows.tolist(), texts))
