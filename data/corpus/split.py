"""Split a mixed corpus (e.g. a globally shuffled one) into one shard set per mixture source.

    python scripts/split_by_source.py 'shuffled/*.parquet' --out by_source --column source \\
        --map 'web=common_crawl*' --map 'code=stack[-_]edu*' --map 'pdfs=olmocr*,s2pdf*' --map 'curated=finemath*,rpj*'

Streams the inputs a row group at a time and appends every row to ``OUT/<source>/part-NNNNN.parquet``
(the input schema; row order kept; each part written under a temp name and renamed when complete).
``--map NAME=PAT,PAT`` takes fnmatch patterns on ``--column`` (Dolma3's ``source`` sub-source, or
``category``); the first mapping that matches a row wins. Rows that match none are counted and
printed, or kept in ``OUT/<--unmapped>/``. ``OUT/split_report.json`` has the counts. Exit status 2
for bad arguments and when no row matched any mapping (nothing is written then), 1 with ``--strict``
when some rows matched no mapping.

The alternative, a ``filter:`` per mixture source over the mixed files, and what it costs in reads
(measured): docs/data-path.md, "Split or filter".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data import files
from data.corpus import PAGE_OPTIONS
from data.corpus.shuffle import cast_to_schema, split_rows_by_label
from data.errors import ConfigError
from data.manifest import matches


@dataclass
class _PartWriter:
    """Appends rows to OUT/<name>/part-NNNNN.parquet, a row group at a time, renaming each part when closed."""

    folder: Path
    schema: pa.Schema
    row_group_rows: int
    rows_per_part: int
    compression: str
    pending: list[pa.Table] = field(default_factory=list)
    pending_rows: int = 0
    part: int = 0
    part_rows: int = 0
    writer: Optional[pq.ParquetWriter] = None
    tmp: Optional[Path] = None
    parts: list[str] = field(default_factory=list)

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        while self.pending_rows >= self.row_group_rows:
            self._write(self.row_group_rows)

    def _write(self, rows: int) -> None:
        table = pa.concat_tables(self.pending)
        head, rest = table.slice(0, rows), table.slice(rows)
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows = rest.num_rows
        if self.writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.tmp = files.temp_path(self.folder / f"part-{self.part:05d}.parquet")
            self.writer = pq.ParquetWriter(self.tmp, self.schema, compression=self.compression, **PAGE_OPTIONS)
        self.writer.write_table(head, row_group_size=rows)
        self.part_rows += head.num_rows
        if self.part_rows >= self.rows_per_part:
            self._close_part()

    def _close_part(self) -> None:
        self.writer.close()
        final = self.folder / f"part-{self.part:05d}.parquet"
        files.publish(self.tmp, final)
        self.parts.append(str(final))
        self.writer, self.tmp, self.part, self.part_rows = None, None, self.part + 1, 0

    def close(self) -> None:
        if self.pending_rows:
            self._write(self.pending_rows)
        if self.writer is not None:
            self._close_part()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.tmp.unlink(missing_ok=True)


def split_by_source(
    inputs: list[str],
    out: str | Path,
    mapping: dict[str, list[str]],
    column: str = "source",
    unmapped: Optional[str] = None,
    row_group_rows: int = 1024,
    rows_per_part: int = 100_000,
    compression: str = "zstd",
    overwrite: bool = False,
) -> dict:
    """Stream ``inputs`` into ``out/<name>/part-NNNNN.parquet`` by fnmatch patterns on ``column``.

    Rows go to the first mapping whose patterns match their value; rows matching none go to
    ``out/<unmapped>/`` when ``unmapped`` is given, else they are left out and reported. Row order
    is kept (input file order, then row order). Memory: one input row group plus less than one
    output row group per source.
    """
    out = Path(out)
    names = list(mapping) + ([unmapped] if unmapped and unmapped not in mapping else [])
    _clear_output(out, names, overwrite)
    schema = _input_schema(inputs, column)
    writers = {name: _PartWriter(out / name, schema, row_group_rows, rows_per_part, compression) for name in names}
    tally = _SplitTally(rows_of=dict.fromkeys(names, 0))
    try:
        for path in inputs:
            _split_file(path, schema, column, mapping, unmapped, writers, tally)
        _close_all(writers, tally, mapping, len(inputs), column)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    report = {"inputs": len(inputs), "column": column, "mapping": mapping, "rows_in": tally.rows_in,
              "rows_out": sum(tally.rows_of.values()), "rows_per_source": tally.rows_of,
              "parts_per_source": {name: len(w.parts) for name, w in writers.items()},
              "unmapped": tally.unmapped_values, "unmapped_to": unmapped,
              "ambiguous_values": sorted(str(v) for v in tally.ambiguous)}
    out.mkdir(parents=True, exist_ok=True)
    files.write_json(out / "split_report.json", report)
    return report


def _close_all(writers: dict[str, "_PartWriter"], tally: "_SplitTally", mapping: dict[str, list[str]], inputs: int,
               column: str) -> None:
    """Publish every writer's last part; when no row matched a mapping, discard everything and refuse."""
    if tally.rows_in and not any(tally.rows_of[name] for name in mapping):
        _discard_all(writers)  # nothing of what was asked for: leave no output at all
        raise _nothing_matched(tally, inputs, column)
    for w in writers.values():
        w.close()


def _split_file(path: str, schema: pa.Schema, column: str, mapping: dict[str, list[str]], unmapped: Optional[str],
                writers: dict[str, "_PartWriter"], tally: "_SplitTally") -> None:
    """One input file, a row group at a time, into the writers of the names its rows' values map to."""
    names = list(writers)
    pf = pq.ParquetFile(path)
    for rg in range(pf.num_row_groups):
        table = cast_to_schema(pf.read_row_group(rg), schema, path).replace_schema_metadata(None)
        labels = _label_rows(table.column(column), mapping, names, unmapped, tally)
        tally.rows_in += table.num_rows
        for name, piece in zip(names, split_rows_by_label(table, labels, len(names) + 1)):
            if piece is not None:
                writers[name].add(piece)
                tally.rows_of[name] += piece.num_rows


@dataclass
class _SplitTally:
    """What :func:`split_by_source` has seen so far (its report)."""

    rows_of: dict[str, int]  # output name -> rows written
    rows_in: int = 0
    unmapped_values: dict[str, int] = field(default_factory=dict)  # value matching no pattern -> rows
    ambiguous: set[str] = field(default_factory=set)  # values matching the patterns of several names


def _clear_output(out: Path, names: list[str], overwrite: bool) -> None:
    """Refuse existing part files unless ``overwrite``; then remove them and any temp left by a killed run."""
    existing = [p for name in names for p in sorted((out / name).glob("part-*.parquet"))]
    if existing and not overwrite:
        raise ConfigError(f"{out}: already holds {len(existing)} part file(s), e.g. {existing[0]}; pass --overwrite")
    for p in existing + [t for name in names for t in (out / name).glob(".part-*.tmp")]:
        p.unlink()


def _input_schema(inputs: list[str], column: str) -> pa.Schema:
    """The first input's schema (metadata dropped): every part is written with it; ``column`` must be in it."""
    schema = pq.read_schema(inputs[0])
    if column not in schema.names:
        raise ConfigError(f"--column {column!r}: not a column of {inputs[0]} (columns: {schema.names})")
    return schema.remove_metadata()


def _label_rows(col: pa.ChunkedArray, mapping: dict[str, list[str]], names: list[str], unmapped: Optional[str],
                tally: _SplitTally) -> np.ndarray:
    """Each row's output: the index in ``names`` of the first mapping that matches its value, the
    ``unmapped`` output, or ``len(names)`` (left out). Counts unmapped and ambiguous values in ``tally``."""
    labels = np.full(len(col), len(names), dtype=np.int64)  # len(names): unmapped, dropped
    seen = np.zeros(len(col), dtype=bool)
    for i, patterns in enumerate(mapping.values()):
        hit = matches(col, patterns).to_numpy(zero_copy_only=False)
        tally.ambiguous.update(v for v in pc.unique(col.filter(pa.array(hit & seen))).to_pylist())
        labels[hit & ~seen] = i
        seen |= hit
    if unmapped and (~seen).any():
        labels[~seen] = names.index(unmapped)
    if (~seen).any():
        for d in pc.value_counts(col.filter(pa.array(~seen))).to_pylist():
            key = "<null>" if d["values"] is None else str(d["values"])
            tally.unmapped_values[key] = tally.unmapped_values.get(key, 0) + d["counts"]
    return labels


def _discard_all(writers: dict[str, _PartWriter]) -> None:
    """Abort every writer and remove the parts they finished."""
    for w in writers.values():
        w.abort()
        for part in w.parts:
            Path(part).unlink(missing_ok=True)


def _nothing_matched(tally: _SplitTally, n_inputs: int, column: str) -> ConfigError:
    seen = ", ".join(f"{v} {n:,}" for v, n in sorted(tally.unmapped_values.items(), key=lambda kv: -kv[1])[:8])
    return ConfigError(
        f"--map: none of the {tally.rows_in:,} rows of {n_inputs} file(s) matched any pattern on column "
        f"{column!r} (values there: {seen}); fix the patterns (fnmatch, case-sensitive) or --column"
    )


def parse_map(items: list[str]) -> dict[str, list[str]]:
    """``['web=cc*,common_crawl*', 'code=stack*']`` -> {"web": ["cc*", "common_crawl*"], "code": ["stack*"]}."""
    mapping: dict[str, list[str]] = {}
    for item in items:
        name, sep, pats = item.partition("=")
        name = name.strip()
        patterns = [p.strip() for p in pats.split(",") if p.strip()]
        if not sep or not name or not patterns:
            raise ConfigError(f"--map {item!r}: expected NAME=PATTERN[,PATTERN...] (e.g. web=common_crawl*,cc*)")
        if "/" in name or name.startswith("."):
            raise ConfigError(f"--map {item!r}: the source name becomes a folder; no '/' or leading '.'")
        mapping.setdefault(name, []).extend(patterns)
    if not mapping:
        raise ConfigError("give at least one --map NAME=PATTERN")
    return mapping
