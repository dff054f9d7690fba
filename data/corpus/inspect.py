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
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

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


def inspect_corpus(root: str | Path, pattern: str = "**/*.parquet") -> CorpusSummary:
    """Rows and ``token_count`` sums per distinct ``source`` and ``category`` value of every parquet file."""
    files = sorted(glob.glob(os.path.join(str(Path(root).expanduser()), pattern), recursive=True))
    if not files:
        raise FileNotFoundError(f"no parquet file under {root} ({pattern})")
    out = CorpusSummary(files=len(files))
    for path in files:
        table = pq.read_table(path, columns=[c for c in (*COLUMNS, "token_count")
                                             if c in pq.read_schema(path).names])
        tokens = table.column("token_count").to_pylist() if "token_count" in table.column_names else None
        out.rows += table.num_rows
        out.tokens += sum(t or 0 for t in tokens) if tokens else 0
        for column in COLUMNS:
            if column not in table.column_names:
                continue
            counts = out.values[column]
            for i, value in enumerate(table.column(column).to_pylist()):
                c = counts.setdefault(value, ValueCount())
                c.rows += 1
                c.tokens += (tokens[i] or 0) if tokens else 0
    return out


def mixture_sources(filters: dict[str, dict | None], column: str, value: str | None) -> list[str]:
    """Mixture sources whose filter on ``column`` takes ``value`` (fnmatchcase, as data/manifest.py does).

    ``filters`` maps a source name to its ``filter`` block (``{column, values}``) or None; a source
    without a filter takes every row of its files, which is reported as ``name(all rows)``."""
    out = []
    for name, flt in filters.items():
        if flt is None:
            out.append(f"{name}(all rows)")
        elif flt["column"] == column and value is not None and any(
                fnmatch.fnmatchcase(value, pat) for pat in flt["values"]):
            out.append(name)
    return out


def filters_of(config_sources: dict) -> dict[str, dict | None]:
    """``data.sources`` of a run YAML -> source name -> its filter block (or None)."""
    return {name: (src or {}).get("filter") for name, src in config_sources.items()}


def format_report(summary: CorpusSummary, filters: dict[str, dict | None] | None = None) -> str:
    lines = [f"{summary.files} files, {summary.rows:,} rows, {summary.tokens:,} tokens (token_count)"]
    filtered_columns = {f["column"] for f in (filters or {}).values() if f}
    unmapped: list[str] = []
    doubled: list[str] = []
    for column in COLUMNS:
        counts = summary.values[column]
        if not counts:
            lines.append(f"\n{column}: (column absent)")
            continue
        show_map = filters is not None and column in filtered_columns
        lines.append(f"\n{column}: {len(counts)} distinct values")
        head = f"  {'value':<40} {'rows':>12} {'tokens':>16} {'share':>7}"
        lines.append(head + ("  mixture source" if show_map else ""))
        for value, c in sorted(counts.items(), key=lambda kv: -kv[1].tokens):
            share = c.tokens / summary.tokens if summary.tokens else 0.0
            row = f"  {str(value):<40} {c.rows:>12,} {c.tokens:>16,} {share:>7.2%}"
            if show_map:
                to = [s for s in mixture_sources(filters, column, value) if "(all rows)" not in s]
                row += "  " + (", ".join(to) if to else "-")
                if not to:
                    unmapped.append(f"{column}={value}")
                elif len(to) > 1:
                    doubled.append(f"{column}={value} -> {', '.join(to)}")
            lines.append(row)
    if filters is not None:
        per_source: dict[str, int] = defaultdict(int)
        for name, flt in filters.items():
            if flt is None:
                continue
            for value, c in summary.values[flt["column"]].items():
                if name in mixture_sources({name: flt}, flt["column"], value):
                    per_source[name] += c.tokens
        lines.append("\ntokens per mixture source (from the filters):")
        for name, flt in filters.items():
            got = "all rows of its files" if flt is None else f"{per_source[name]:,}"
            lines.append(f"  {name:<12} {got}" + ("   <- MATCHES NOTHING" if flt and not per_source[name] else ""))
        if unmapped:
            lines.append(f"\nnot taken by any filter (never trained on): {', '.join(unmapped)}")
        if doubled:
            lines.append("taken by several filters (trained twice): " + "; ".join(doubled))
    return "\n".join(lines)
