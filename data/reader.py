"""Reading documents by address: chunk row ranges and single rows, tokenized on the way out.

Parquet reads whole row groups, so a chunk (a row range inside one row group) costs one row-group
read of the text column (plus the filter column when the source has a row filter), and restoring a
buffer groups its addresses by row group so each is read once.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.config import DataConfig
from data.manifest import Chunk, Manifest, matches
from data.tokenizer import encode_docs


class ShardReader:
    def __init__(self, manifest: Manifest, cfg: DataConfig, max_open_files: int = 32):
        self.manifest = manifest
        self.text_column = cfg.text_column
        self.threads = cfg.tokenizer_threads
        self.filters = [info.filter for info in manifest.sources.values()]
        self._files: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._max_open = max_open_files

    def _file(self, shard: int) -> pq.ParquetFile:
        pf = self._files.pop(shard, None)
        if pf is None:
            try:
                pf = pq.ParquetFile(self.manifest.shards[shard].path)
            except Exception as e:
                raise RuntimeError(f"{self.manifest.shards[shard].path}: cannot open parquet file: {e}") from e
            if len(self._files) >= self._max_open:
                self._files.popitem(last=False)
        self._files[shard] = pf
        return pf

    def _row_group(self, shard: int, row: int) -> tuple[int, int]:
        for i, (first, n) in enumerate(self.manifest.shards[shard].row_groups):
            if first <= row < first + n:
                return i, first
        raise IndexError(f"{self.manifest.shards[shard].path}: row {row} out of range")

    def _read(self, source: int, shard: int, rg: int) -> pa.Table:
        filt = self.filters[source]
        cols = [self.text_column] + ([filt.column] if filt else [])
        try:
            return self._file(shard).read_row_group(rg, columns=cols)
        except Exception as e:
            raise RuntimeError(
                f"{self.manifest.shards[shard].path}: row group {rg} unreadable (file changed or corrupt "
                f"since the manifest was built?): {e}"
            ) from e

    def read_chunk(self, source: int, chunk: Chunk, skip: int = 0) -> tuple[list[int], list[np.ndarray]]:
        """Rows of the chunk that belong to the source (filter applied), minus the first ``skip``."""
        rg, first = self._row_group(chunk.shard, chunk.start)
        table = self._read(source, chunk.shard, rg).slice(chunk.start - first, chunk.stop - chunk.start)
        rows = np.arange(chunk.start, chunk.stop)
        filt = self.filters[source]
        if filt:
            mask = matches(table.column(filt.column), filt.values).to_numpy(zero_copy_only=False)
            rows = rows[mask]
            table = table.filter(pa.array(mask))
        texts = table.column(self.text_column).to_pylist()[skip:]
        return rows[skip:].tolist(), encode_docs(texts, self.threads)

    def read_docs(self, source: int, addrs: list[tuple[int, int]]) -> list[np.ndarray]:
        """Tokens of documents given as (shard, row), in the given order; one read per row group."""
        by_group: dict[tuple[int, int], list[int]] = defaultdict(list)
        located = []
        for shard, row in addrs:
            rg, first = self._row_group(shard, row)
            by_group[(shard, rg)].append(row - first)
            located.append((shard, rg, row - first))
        texts: dict[tuple[int, int, int], str] = {}
        for (shard, rg), offsets in by_group.items():
            col = self._read(source, shard, rg).column(self.text_column)
            uniq = sorted(set(offsets))
            for off, text in zip(uniq, col.take(pa.array(uniq)).to_pylist()):
                texts[(shard, rg, off)] = text
        return encode_docs([texts[key] for key in located], self.threads)
