"""What a downloaded corpus holds, and which mixture source each row would feed, before any compute.

The real config maps Dolma3 sub-sources to mixture sources with fnmatch filters on the ``source`` (or
``category``) column (``web: common_crawl*``, ...). Those names were written from the dataset card,
not checked against the files: a pattern that matches nothing fails at start-up, but one that
matches the wrong rows, or a sub-source no filter takes, goes unnoticed until the mixture is off.
:func:`inspect_corpus` counts rows and tokens per distinct value (reading only the small columns,
never ``text``), and :func:`format_report` prints them with the mixture source(s) each value goes to
-- ``-`` for none, several names for a value two filters take (its rows would be trained twice).

    python scripts/inspect_corpus.py $DOLMA3_DIR [--config configs/pretrain_350m_20b.yaml]
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import DataError
from data.mapping import count_values

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


def mixture_sources(filters: dict[str, dict | None], column: str, value: str | None) -> list[str]:
    """Mixture sources whose filter on ``column`` takes ``value`` (fnmatchcase, as data/manifest.py does).

    ``filters`` maps a source name to its ``filter`` block (``{column, values}``) or None; a source
    without a filter takes every row of its files, which is reported as ``name(all rows)``."""
    out = []
    for name, flt in filters.items():
        if flt is None:
            out.append(f"{name}(all rows)")
        elif flt["column"] == column and value is not None and any(
                fnmatch.fnmatchcase(value, pat) for pat in [*flt["values"], *flt.get("optional", [])]):
            out.append(name)
    return out


def filters_of(config_sources: dict) -> dict[str, dict | None]:
    """``data.sources`` of a run YAML -> source name -> its filter block (or None)."""
    return {name: (src or {}).get("filter") for name, src in config_sources.items()}


def format_report(summary: CorpusSummary, filters: dict[str, dict | None] | None = None) -> str:
    """The corpus totals and a table of values per column; with `filters`, also the mixture source(s)
    each value goes to, the tokens per mixture source, and the values no filter or several take."""
    lines = [f"{summary.files} files, {summary.rows:,} rows, {summary.tokens:,} tokens (token_count)"]
    mapped = _mapped_columns(filters)
    for column in COLUMNS:
        lines += _value_table(summary, column, filters if column in mapped else None)
    if filters is not None:
        lines += _mixture_totals(summary, filters)
        lines += _mapping_problems(summary, filters)
    return "\n".join(lines)


def _mapped_columns(filters: dict[str, dict | None] | None) -> set[str]:
    """The columns some filter reads (none without `filters`)."""
    return {f["column"] for f in (filters or {}).values() if f}


def _by_tokens(counts: dict[str | None, ValueCount]) -> list[tuple[str | None, ValueCount]]:
    return sorted(counts.items(), key=lambda kv: -kv[1].tokens)


def _filtered_sources(filters: dict[str, dict | None], column: str, value: str | None) -> list[str]:
    """The mixture sources whose filter takes `value` (sources without a filter left out)."""
    return [s for s in mixture_sources(filters, column, value) if "(all rows)" not in s]


def _value_table(summary: CorpusSummary, column: str, filters: dict[str, dict | None] | None) -> list[str]:
    """Rows, tokens and share per value of `column`, with the mixture sources taking it when `filters`."""
    counts = summary.values[column]
    if not counts:
        return [f"\n{column}: (column absent)"]
    head = f"  {'value':<40} {'rows':>12} {'tokens':>16} {'share':>7}"
    lines = [f"\n{column}: {len(counts)} distinct values", head + ("  mixture source" if filters is not None else "")]
    for value, c in _by_tokens(counts):
        share = c.tokens / summary.tokens if summary.tokens else 0.0
        row = f"  {str(value):<40} {c.rows:>12,} {c.tokens:>16,} {share:>7.2%}"
        if filters is not None:
            row += "  " + (", ".join(_filtered_sources(filters, column, value)) or "-")
        lines.append(row)
    return lines


def _mixture_totals(summary: CorpusSummary, filters: dict[str, dict | None]) -> list[str]:
    """Tokens each mixture source's filter takes; a filter taking nothing is flagged."""
    per_source: dict[str, int] = defaultdict(int)
    for name, flt in filters.items():
        if flt is None:
            continue
        for value, c in summary.values[flt["column"]].items():
            if name in mixture_sources({name: flt}, flt["column"], value):
                per_source[name] += c.tokens
    lines = ["\ntokens per mixture source (from the filters):"]
    for name, flt in filters.items():
        got = "all rows of its files" if flt is None else f"{per_source[name]:,}"
        lines.append(f"  {name:<12} {got}" + ("   <- MATCHES NOTHING" if flt and not per_source[name] else ""))
    return lines


def _mapping_problems(summary: CorpusSummary, filters: dict[str, dict | None]) -> list[str]:
    """The values of filtered columns that no filter takes, and those several filters take."""
    unmapped: list[str] = []
    doubled: list[str] = []
    mapped = _mapped_columns(filters)
    for column in (c for c in COLUMNS if c in mapped):
        for value, _ in _by_tokens(summary.values[column]):
            to = _filtered_sources(filters, column, value)
            if not to:
                unmapped.append(f"{column}={value}")
            elif len(to) > 1:
                doubled.append(f"{column}={value} -> {', '.join(to)}")
    lines = []
    if unmapped:
        lines.append(f"\nnot taken by any filter (never trained on): {', '.join(unmapped)}")
    if doubled:
        lines.append("taken by several filters (trained twice): " + "; ".join(doubled))
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
