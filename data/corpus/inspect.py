"""What a downloaded corpus holds, and which mixture source each row would feed, before any compute.

The real config maps Dolma3 sub-sources to mixture sources with fnmatch filters on the ``source`` (or
``category``) column (``web: common_crawl*``, ...). Those names were written from the dataset card,
not checked against the files: a pattern that matches nothing fails at start-up, but one that
matches the wrong rows, or a sub-source no filter takes, goes unnoticed until the mixture is off.
:func:`inspect_corpus` counts rows and tokens per distinct value (reading only the small columns,
never ``text``), and :func:`format_report` prints them with the mixture source(s) each value goes to
under the config's mapping report (data/mapping.py) -- ``-`` for none, several names for a value two
filters take (its rows would be trained twice).

    python scripts/inspect_corpus.py $DOLMA3_DIR [--config configs/pretrain_350m_20b.yaml]
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import DataError
from data.mapping import MappingReport, count_values

COLUMNS = ("source", "category")


@dataclass
class ValueCount:
    rows: int = 0
    tokens: int = 0


@dataclass
class CorpusSummary:
    files: int = 0
    rows: int = 0
    tokens: int = 0
    values: dict[str, dict[str | None, ValueCount]] = field(default_factory=lambda: {c: {} for c in COLUMNS})
    per_file: dict[tuple[str, str], dict[str | None, list[int]]] = field(default_factory=dict)
    """(path, column) -> value -> [rows, tokens]: the mapping report's input (data/mapping.py)."""
    paths: list[str] = field(default_factory=list)


def inspect_corpus(root: str | Path, pattern: str = "**/*.parquet") -> CorpusSummary:
    """Rows and ``token_count`` sums per distinct ``source`` and ``category`` value of every parquet file."""
    files = sorted(glob.glob(os.path.join(str(Path(root).expanduser()), pattern), recursive=True))
    if not files:
        raise FileNotFoundError(f"no parquet file under {root} ({pattern})")
    return summarize(files)


def summarize(files: list[str]) -> CorpusSummary:
    """Rows and ``token_count`` sums per distinct ``source`` and ``category`` value of each of ``files``."""
    out = CorpusSummary(files=len(files), paths=files)
    for path in files:
        table = _small_columns(path)
        out.rows += table.num_rows
        out.tokens += int(pc.sum(table.column("token_count")).as_py() or 0)
        for column in (c for c in COLUMNS if c in table.column_names):
            mine = out.per_file[(path, column)] = count_values(table, column, {})
            for value, (rows, tokens) in mine.items():
                c = out.values[column].setdefault(value, ValueCount())
                c.rows, c.tokens = c.rows + rows, c.tokens + tokens
    return out


def _small_columns(path: str) -> pa.Table:
    """A file's ``source``, ``category`` and ``token_count`` columns (token_count 0 where it has none)."""
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in (*COLUMNS, "token_count") if c in names])
    except (OSError, pa.ArrowException) as e:  # truncated, corrupt, or not parquet at all
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable parquet file ({reason}); remove or re-download it, or "
                        "leave it out with --pattern") from None
    if "token_count" not in table.column_names:
        table = table.append_column("token_count", pa.array(np.zeros(table.num_rows, dtype=np.int64)))
    return table


def format_report(summary: CorpusSummary, mapping: MappingReport | None = None) -> str:
    """The corpus totals and a table of values per column; with the ``mapping`` report of a config's
    filters (data/mapping.py, printed after this table), the mixture source(s) each value goes to."""
    lines = [f"{summary.files} files, {summary.rows:,} rows, {summary.tokens:,} tokens (token_count)"]
    takers = _takers(mapping)
    for column in COLUMNS:
        lines += _value_table(summary, column, takers.get(column))
    return "\n".join(lines)


def _takers(mapping: MappingReport | None) -> dict[str, dict[str | None, list[str]]]:
    """Per filter column, per value: the mixture sources whose patterns take it, in config order."""
    sources = mapping.sources if mapping else []
    out: dict[str, dict[str | None, list[str]]] = {sm.column: {} for sm in sources if sm.column}
    for sm in sources:
        for value in {v for pm in sm.patterns for v in pm.values}:
            out[sm.column].setdefault(value, []).append(sm.name)
    return out


def _by_tokens(counts: dict[str | None, ValueCount]) -> list[tuple[str | None, ValueCount]]:
    return sorted(counts.items(), key=lambda kv: -kv[1].tokens)


def _value_table(summary: CorpusSummary, column: str, takers: dict[str | None, list[str]] | None) -> list[str]:
    """Rows, tokens and share per value of `column`, with the mixture sources taking it when `takers`."""
    counts = summary.values[column]
    if not counts:
        return [f"\n{column}: (column absent)"]
    head = f"  {'value':<40} {'rows':>12} {'tokens':>16} {'share':>7}"
    lines = [f"\n{column}: {len(counts)} distinct values", head + ("  mixture source" if takers is not None else "")]
    for value, c in _by_tokens(counts):
        share = c.tokens / summary.tokens if summary.tokens else 0.0
        row = f"  {str(value):<40} {c.rows:>12,} {c.tokens:>16,} {share:>7.2%}"
        lines.append(row + ("  " + (", ".join(takers.get(value, [])) or "-") if takers is not None else ""))
    return lines


SLOTS = {  # mixture source -> Dolma 3 sub-source families (compared with '-' read as '_')
    "web": ("common_crawl",),
    "code": ("stack_edu",),
    "pdfs": ("olmocr_science_pdfs", "s2pdf"),
    "curated": ("finemath", "rpj", "arxiv", "dolma1_7", "wiki"),
}


def propose_sources(summary: CorpusSummary, paths: str = "$DOLMA3_DIR/**/*.parquet") -> str:
    """A ``sources:`` block for the ``source`` values found: each Dolma 3 family as spelled in the files
    (both spellings when both occur) put in its slot; values of no known family listed as comments."""
    patterns, left = _slot_patterns(summary)
    lines = ["  sources:   # proposed by scripts/inspect_corpus.py from the `source` values above; paste under data:"]
    lines += [f'    {slot + ":":<9}{{paths: ["{paths}"], filter: {{column: source, values: ['
              + ", ".join(f'"{p}"' for p in pats) + "]}}" for slot, pats in patterns.items() if pats]
    if left:
        lines += ["  # values of no Dolma 3 family (never read unless a pattern above takes them; start-up refuses",
                  "  # them above data.unclaimed of the tokens):"] + ["  " + ln for ln in left]
    return "\n".join(lines)


def _slot_patterns(summary: CorpusSummary) -> tuple[dict[str, list[str]], list[str]]:
    """Per slot the family patterns of the ``source`` values found; the comment lines of the other values."""
    patterns: dict[str, list[str]] = {slot: [] for slot in SLOTS}
    left: list[str] = []
    for value, c in sorted(summary.values["source"].items(), key=lambda kv: str(kv[0])):
        slot, family = _slot_of(value)
        if slot is None:
            left.append(f"#   {value!s:<40} {c.rows:>10,} rows {c.tokens / (summary.tokens or 1):>8.3%} of the tokens")
        elif value[:len(family)] + "*" not in patterns[slot]:
            patterns[slot].append(value[:len(family)] + "*")
    return patterns, left


def _slot_of(value: str | None) -> tuple[str | None, str | None]:
    """The mixture slot and Dolma 3 family of a ``source`` value (``-`` read as ``_``), or (None, None)."""
    norm = (value or "").replace("-", "_")
    return next(((s, f) for s, fams in SLOTS.items() for f in fams if norm.startswith(f)), (None, None))


def duplicate_counts(paths: list[str], sample_rows: int = 20_000, seed: int = 0) -> dict[str | None, list[int]]:
    """``source`` value -> [sampled rows, rows whose text already occurred in the sample] over up to
    ``sample_rows`` rows of row groups drawn at random (the mix upsamples documents up to 7x)."""
    groups = [(p, g) for p in paths for g in range(pq.ParquetFile(p).num_row_groups)]
    seen: set[bytes] = set()
    out: dict[str | None, list[int]] = {}
    taken = 0
    for i in np.random.default_rng(seed).permutation(len(groups)):
        if taken >= sample_rows:
            break
        path, g = groups[i]
        cols = [c for c in ("source", "text") if c in pq.read_schema(path).names]
        if "text" in cols:
            taken += _count_duplicates(pq.ParquetFile(path).read_row_group(g, columns=cols), seen, out)
    return out


def _count_duplicates(table: pa.Table, seen: set[bytes], out: dict[str | None, list[int]]) -> int:
    """Add one row group's texts to ``seen`` and its [rows, repeats] per ``source`` value to ``out``; its rows."""
    texts = table.column("text").cast(pa.large_binary()).to_pylist()
    values = table.column("source").to_pylist() if "source" in table.column_names else [None] * len(texts)
    for value, text in zip(values, texts):
        digest = hashlib.blake2b(text or b"", digest_size=16).digest()
        acc = out.setdefault(value, [0, 0])
        acc[0] += 1
        acc[1] += digest in seen
        seen.add(digest)
    return len(texts)


def format_duplicates(counts: dict[str | None, list[int]]) -> str:
    rows = sum(n for n, _ in counts.values())
    dups = sum(d for _, d in counts.values())
    lines = [f"duplicate texts in a sample of {rows:,} rows: {dups:,} ({dups / max(rows, 1):.2%}) repeat an "
             "earlier text of the sample",
             f"  {'source':<40} {'sampled':>10} {'duplicates':>10}"]
    for value, (n, d) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {value!s:<40} {n:>10,} {d:>10,}")
    return "\n".join(lines)
