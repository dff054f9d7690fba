"""The start-up mapping report: which filter-column values each mixture source's patterns take.

A corpus whose files mix sub-sources (Dolma 3: the ``source`` column) is mapped onto the mixture
sources by fnmatch patterns (``data.sources.<name>.filter``). Patterns written from a dataset card
can be wrong in two silent ways: one matches nothing (the source is then made of the other patterns
alone), or a sub-source is spelled differently and no pattern takes it (its rows are never read).
:func:`build_mapping` works from the per-file value counts the manifest scan already collects
(footer-cheap: the filter and ``token_count`` columns only) and lists, per mixture source and per
pattern, the distinct values matched with their rows and tokens; then every value no mixture source
claims, with its share of the tokens in those files. Its problems (start-up errors, raised by
data/manifest.py before any compute):

- a pattern of ``filter.values`` that matches no value in the source's files (patterns listed in
  ``filter.optional`` may match nothing);
- unclaimed values holding more than ``data.unclaimed`` of the tokens (below it: a warning);
- a value two mixture sources claim in the same file (its rows would be trained twice).

The report is logged at start-up and written to ``<run.dir>/corpus_mapping.txt``;
``scripts/inspect_corpus.py`` and ``scripts/plan.py`` print it too.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from data.config import DataConfig

log = logging.getLogger(__name__)

REPORT_FILE = "corpus_mapping.txt"
"""The report's name in the run directory."""

ValueCounts = dict[str | None, list[int]]  # value -> [rows, tokens]; None: null (never claimed by a filter)


@dataclass
class PatternMatch:
    pattern: str
    optional: bool
    values: ValueCounts = field(default_factory=dict)


@dataclass
class SourceMapping:
    name: str
    column: str | None  # None: no filter, every row of its files
    files: int
    patterns: list[PatternMatch] = field(default_factory=list)
    rows: int = 0
    tokens: int = 0


@dataclass
class MappingReport:
    sources: list[SourceMapping]
    unclaimed: dict[str, ValueCounts]  # column -> values no source claims
    totals: dict[str, list[int]]  # column -> [files, tokens] of the files the filters on it read
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def text(self, problems: bool = True) -> str:
        """Per mixture source, each pattern and the values it matched; then the unclaimed values (and, with
        ``problems``, the errors and warnings)."""
        lines = ["corpus mapping (filter patterns -> values in the files; rows and token_count sums)"]
        for sm in self.sources:
            lines += _source_lines(sm, self.totals.get(sm.column, [0, 0])[1])
        for column, (files, tokens) in self.totals.items():
            counts = self.unclaimed.get(column, {})
            if not counts:
                lines.append(f"unclaimed `{column}` values: none ({files} file(s), {tokens:,} tokens)")
                continue
            lines.append(f"unclaimed `{column}` values (never read):")
            lines += [f"    {value if value is not None else '(null)':<40} {rows:>12,} rows {vt:>16,} tokens "
                      f"{vt / tokens if tokens else 0.0:>8.3%}" for value, (rows, vt) in _by_tokens(counts)]
        if problems:
            lines += [f"error: {e}" for e in self.errors] + [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def count_values(table: pa.Table, column: str, out: ValueCounts) -> ValueCounts:
    """Add the rows and ``token_count`` sums per distinct value of ``column`` (null: a value) to ``out``."""
    agg = table.group_by(column).aggregate([("token_count", "count", pc.CountOptions(mode="all")),
                                            ("token_count", "sum")])
    for value, rows, tokens in zip(*(agg.column(c).to_pylist() for c in (column, "token_count_count",
                                                                            "token_count_sum"))):
        _add(out, value, rows, tokens or 0)
    return out


def matches(column: pa.ChunkedArray | pa.Array, patterns: list[str]) -> pa.Array:
    """Boolean mask of the rows whose value matches any fnmatch pattern (case-sensitive).

    The patterns are matched in Python against the column's distinct values (a handful of
    sub-source names), not translated into a regex: Arrow's RE2 engine rejects the ``\\Z`` that
    ``fnmatch.translate`` emits, and a regex search would also match substrings.
    """
    values = pc.unique(column).to_pylist()
    keep = [v for v in values if v is not None and any(fnmatch.fnmatchcase(v, pat) for pat in patterns)]
    return pc.fill_null(pc.is_in(column, value_set=pa.array(keep, type=column.type)), False)


def _add(counts: ValueCounts, value: str, rows: int, tokens: int) -> None:
    acc = counts.setdefault(value, [0, 0])
    acc[0] += rows
    acc[1] += tokens


def build_mapping(cfg: DataConfig, files_per_source: dict[str, list[str]],
                  values_of: dict[tuple[str, str], ValueCounts]) -> MappingReport:
    """The report from ``values_of[(path, column)]`` (every value of the filter column in that file)."""
    readers: dict[str, list[str]] = {}  # path -> sources reading it
    for name, files in files_per_source.items():
        for path in files:
            readers.setdefault(path, []).append(name)
    doubled: dict[tuple[str, str], set[str]] = {}  # (column, value) -> sources claiming it in one file
    sources = [_map_source(cfg, name, files, values_of, readers, doubled)
               for name, files in files_per_source.items()]
    filtered = {src.filter.column for src in cfg.sources.values() if src.filter is not None}
    unclaimed, totals = _unclaimed(cfg, readers, {k: v for k, v in values_of.items() if k[1] in filtered})
    report = MappingReport(sources, unclaimed, totals)
    _judge(report, cfg, doubled)
    return report


def _map_source(cfg: DataConfig, name: str, files: list[str], values_of: dict[tuple[str, str], ValueCounts],
                readers: dict[str, list[str]], doubled: dict[tuple[str, str], set[str]]) -> SourceMapping:
    """One source's patterns with the values each takes first; values another source reading the same
    file also claims are added to `doubled`."""
    filt = cfg.sources[name].filter
    if filt is None:
        return SourceMapping(name, None, len(files))
    files = [p for p in files if (p, filt.column) in values_of]
    sm = SourceMapping(name, filt.column, len(files), [PatternMatch(p, p not in filt.values) for p in filt.patterns])
    for path in files:
        for value, (rows, tokens) in values_of[(path, filt.column)].items():
            hit = next((pm for pm in sm.patterns if _claims(pm.pattern, value)), None)
            if hit is not None:
                _add(hit.values, value, rows, tokens)
                sm.rows, sm.tokens = sm.rows + rows, sm.tokens + tokens
                _note_double_claim(cfg, name, path, filt.column, value, readers, doubled)
    return sm


def _claims(pattern: str, value: str | None) -> bool:
    return value is not None and fnmatch.fnmatchcase(value, pattern)


def _takes(filt, column: str, value: str | None) -> bool:
    """Whether a source's filter takes ``value`` of ``column`` (a source without a filter takes every row)."""
    return filt is None or (filt.column == column and any(_claims(p, value) for p in filt.patterns))


def _note_double_claim(cfg: DataConfig, name: str, path: str, column: str, value: str,
                       readers: dict[str, list[str]], doubled: dict[tuple[str, str], set[str]]) -> None:
    others = [o for o in readers[path] if o != name and _takes(cfg.sources[o].filter, column, value)]
    if others:
        doubled.setdefault((column, value), set()).update([name, *others])


def _unclaimed(cfg: DataConfig, readers: dict[str, list[str]], values_of: dict[tuple[str, str], ValueCounts]):
    """Per filter column: the values no source reading their file claims, and [files, tokens] read."""
    unclaimed: dict[str, ValueCounts] = {}
    totals: dict[str, list[int]] = {}
    for (path, column), counts in sorted(values_of.items()):
        if path not in readers:
            continue
        tot = totals.setdefault(column, [0, 0])
        tot[0] += 1
        for value, (rows, tokens) in counts.items():
            tot[1] += tokens
            if not any(_takes(cfg.sources[n].filter, column, value) for n in readers[path]):
                _add(unclaimed.setdefault(column, {}), value, rows, tokens)
    return unclaimed, totals


def _judge(report: MappingReport, cfg: DataConfig, doubled: dict) -> None:
    report.errors += [
        f"data.sources.{sm.name}.filter.values: pattern '{pm.pattern}' matches no `{sm.column}` value in the "
        f"source's {sm.files} file(s); fix the pattern (fnmatch, case-sensitive; the report lists the values "
        "there), or move it to filter.optional if the corpus may lack that sub-source"
        for sm in report.sources for pm in sm.patterns if not pm.values and not pm.optional]
    for column, counts in report.unclaimed.items():
        total = report.totals[column][1]
        share = sum(t for _, t in counts.values()) / total if total else 0.0
        line = _unclaimed_line(column, counts, share)
        if share > cfg.unclaimed:
            report.errors.append(f"data.unclaimed: {line}; above the limit {cfg.unclaimed:.3%}. Add patterns for "
                                 "them to a source's filter, or raise data.unclaimed to leave them out")
        else:
            report.warnings.append(f"{line} (below data.unclaimed {cfg.unclaimed:.3%})")
    report.errors += [f"data.sources: `{column}` value '{value}' is claimed by {', '.join(sorted(names))} in the same "
                      "files: its rows would be trained twice; narrow the patterns"
                      for (column, value), names in sorted(doubled.items())]


def _unclaimed_line(column: str, counts: ValueCounts, share: float) -> str:
    top = _by_tokens(counts)[:8]
    names = ", ".join(f"'{v}'" if v is not None else "null" for v, _ in top)
    return (f"`{column}` value(s) {names}{' ...' if len(counts) > 8 else ''} ({len(counts)} in all, "
            f"{share:.3%} of the tokens) are claimed by no mixture source: their rows are never read")


def _by_tokens(counts: ValueCounts) -> list[tuple[str | None, list[int]]]:
    return sorted(counts.items(), key=lambda kv: -kv[1][1])


def _source_lines(sm: SourceMapping, total: int) -> list[str]:
    """One source's line, then per pattern the values it matched (or MATCHES NOTHING)."""
    if sm.column is None:
        return [f"{sm.name}: no filter: every row of its {sm.files} file(s)"]
    share = f"{sm.tokens / total:.2%}" if total else "-"
    lines = [f"{sm.name}: {sm.rows:,} rows, {sm.tokens:,} tokens ({share}) from {sm.files} file(s), "
             f"filter on `{sm.column}`"]
    for pm in sm.patterns:
        tag = " (optional)" if pm.optional else ""
        lines.append(f"  {pm.pattern!r}{tag}:" + ("" if pm.values else " MATCHES NOTHING"))
        lines += [f"    {value:<40} {rows:>12,} rows {tokens:>16,} tokens"
                  for value, (rows, tokens) in _by_tokens(pm.values)]
    return lines


def write_mapping_report(report: MappingReport | None, run_dir: str | Path) -> Path | None:
    """Log the report and write it to ``<run_dir>/corpus_mapping.txt`` (atomically)."""
    from data.files import write_text

    if report is None:
        return None
    text = report.text()
    log.info("%s", text)
    path = Path(run_dir) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text + "\n")
    return path
