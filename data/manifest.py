"""The manifest: every shard, row group, row and token count per source -- from metadata, no text read.

Built once at start-up, before any compute, and cached (keyed by each file's path, size and mtime),
so a 20B-token corpus starts in seconds instead of a rescan. Building it is also where bad input
is caught: a missing or empty glob, a missing column, a wrong column type, a truncated or corrupt
file -> one ``ConfigError`` that names every bad file and its problem. With ``on_bad_shard: skip``
bad files are logged, left out and counted in ``Manifest.skipped`` instead.

The ``token_count`` column is not trusted blindly (it sizes every plan, epoch and hold-out): a negative
count is a bad file; per source, :data:`SAMPLE_ROWS` documents chosen with a fixed seed are tokenized
with cl100k and the column's sum over them must be within :data:`TOKEN_COUNT_RATIO` of the real
count (a x100 or /1000 column names its file); a source whose documents are all empty is an error.
Null ``text`` values are counted from the footers (no text read) into ``Manifest.null_texts`` and logged
naming the file; ``train fit`` refuses them at start-up unless ``on_bad_shard: skip`` (then the reader
leaves those rows out, data/reader.py). The cache keeps
each file's scan (null counts included) and each source's sample outcome, so a cached start-up
re-applies every check without reading text.

Where sources filter mixed files, the scan also counts rows and tokens per value of the filter column;
the mapping report built from them (data/mapping.py) stops the build on a pattern that matches nothing,
on unclaimed values above ``data.unclaimed`` of the tokens and on a value two sources claim. The
fingerprint a checkpoint keeps covers each file's size, footer hash (:func:`file_digest`, read at every
start and part of the cache key) and ``token_count`` checksum, so a file rewritten in place is named at
resume. A folder of global-shuffle buckets without its completion record is refused (data/shuffled.py).
Also named here: a configured column missing from every file (the key to set), a sampled text that is
not valid UTF-8 (file and row), a source whose sampled texts are all empty, and ``token_count`` zeros
when tokens are to be held out.

The unit of splitting is the *chunk*: a row range inside one row group of one shard. A source gets
one chunk per row group, and its row groups are split into equal row ranges until it has at least
``min_chunks_per_source`` chunks, so a 2-shard curated source still spreads over 64 consumers. The
chunking depends on the files only, never on the number of ranks or workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import logging
import math
import os
import textwrap
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.config import SCHEMA, DataConfig, FilterConfig, SourceConfig, no_match_reason
from data.errors import ConfigError
from data.files import file_digest, file_identity, write_text
from data.mapping import MappingReport, build_mapping, count_values
from data.shuffled import shuffle_problems

log = logging.getLogger(__name__)

MANIFEST_VERSION = 3  # bump when the cached entry layout changes (the cache file name carries it)
SAMPLE_ROWS = 16  # documents per source whose token_count is compared with a real cl100k count
TOKEN_COUNT_RATIO = (0.5, 2.0)  # allowed token_count / real count over a source's sample
SAMPLE_SCAN_ROWS = 256  # rows read from the start of a sampled row group (never the whole group)
_STRING_TYPES = (pa.string(), pa.large_string())


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of one shard, inside a single row group."""

    shard: int  # index into Manifest.shards
    start: int
    stop: int


@dataclass
class Shard:
    path: str
    stem: str  # prefix of document IDs: "<stem>:<row>"
    row_groups: list[tuple[int, int]]  # (first row, rows) per row group
    digest: str = ""  # the file's size, footer and token_count column (:func:`file_digest`, the scan)


@dataclass
class SourceInfo:
    name: str
    filter: FilterConfig | None
    chunks: list[Chunk]  # canonical order: by shard, then row
    val_chunks: list[Chunk]  # held out for validation, never read by training
    docs: int
    tokens: int  # sum of the token_count column over the training chunks' documents
    shards: list[int]

    @property
    def stream_tokens(self) -> int:
        """Tokens one epoch of this source puts into sequences: its text tokens plus one EOT per document."""
        return self.tokens + self.docs


@dataclass
class Manifest:
    shards: list[Shard]
    sources: dict[str, SourceInfo]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, problem)
    null_texts: dict[str, list[list[int]]] = field(default_factory=dict)  # path -> [row group, nulls] (footers)
    mapping: MappingReport | None = None  # filter patterns -> values (data/mapping.py)

    @property
    def source_names(self) -> list[str]:
        return list(self.sources)

    def fingerprint(self) -> str:
        """Identifies the corpus as the data path sees it: files, row groups, each file's bytes as far as
        its size, parquet footer (every column chunk's offsets, sizes and statistics) and token_count
        column show them, filters and chunking."""
        h = hashlib.sha256()
        for s in self.shards:
            h.update(f"{s.stem}|{s.row_groups}|{s.digest}\n".encode())
        for name, src in self.sources.items():
            h.update(f"{name}|{src.filter}|{len(src.chunks)}|{src.docs}|{src.tokens}\n".encode())
        return h.hexdigest()[:16]

    def file_digests(self) -> dict[str, str]:
        """Per file (its doc-ID stem): the digest the fingerprint is made of, for naming a changed file."""
        return {s.stem: s.digest for s in self.shards}

    def changed_files(self, old: dict[str, str] | None) -> list[str]:
        """The files whose digest differs from ``old`` (:meth:`file_digests` of a saved run), named by path."""
        if not old:
            return []
        now = {s.stem: s for s in self.shards}
        out = [f"{now[k].path} (bytes changed)" for k in now if k in old and old[k] != now[k].digest]
        out += [f"{now[k].path} (new)" for k in now if k not in old]
        out += [f"{k} (gone)" for k in old if k not in now]
        return out

    def doc_id(self, shard: int, row: int) -> str:
        return f"{self.shards[shard].stem}:{row}"

    def summary(self) -> str:
        lines = [f"{'source':<10} {'shards':>6} {'chunks':>7} {'docs':>10} {'tokens':>14}"]
        for name, src in self.sources.items():
            lines.append(f"{name:<10} {len(src.shards):>6} {len(src.chunks):>7} {src.docs:>10,} {src.tokens:>14,}")
        if self.skipped:
            lines.append(
                f"skipped {len(self.skipped)} bad file(s): " + "; ".join(f"{p}: {why}" for p, why in self.skipped)
            )
        return "\n".join(lines)


def _cache_dir(cfg: DataConfig) -> Path:
    root = cfg.manifest_cache or os.environ.get("WELLMIXED_CACHE") or "~/.cache/wellmixed"
    return Path(root).expanduser()


def _check_schema(pf: pq.ParquetFile, needed: dict[str, str]) -> str | None:
    schema = pf.schema_arrow
    problems = []
    for col, want in needed.items():
        if col not in schema.names:
            problems.append(f"missing column '{col}'")
            continue
        got = schema.field(col).type
        ok = got in _STRING_TYPES if want == "string" else str(got) == want
        if not ok:
            problems.append(f"column '{col}' has type {got}, expected {want}")
    return "; ".join(problems) or None


def _scan_file(path: str, needed: dict[str, str], filt: FilterConfig | None, text_column: str = "text") -> dict:
    """Row groups with (rows, matching docs, matching tokens). Raises ValueError(problem)."""
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid for truncated files / bad magic, OSError for unreadable
        raise ValueError(f"not a readable parquet file (truncated or corrupt?): {e}") from None
    problem = _check_schema(pf, needed)
    if problem:
        raise ValueError(problem)
    groups = []
    first = 0
    values: dict = {}
    crc = 0
    cols = ["token_count"] + ([filt.column] if filt else [])
    for i in range(pf.num_row_groups):
        rows = pf.metadata.row_group(i).num_rows
        try:
            table = pf.read_row_group(i, columns=cols)
        except Exception as e:
            raise ValueError(f"row group {i} unreadable (truncated or corrupt?): {e}") from None
        counts = table.column("token_count")
        if counts.null_count:
            raise ValueError(f"row group {i}: token_count has {counts.null_count} null value(s)")
        negative = pc.sum(pc.less(counts, 0)).as_py() or 0
        if negative:
            raise ValueError(f"row group {i}: token_count has {negative} negative value(s) (min "
                             f"{pc.min(counts).as_py()}); it must be each document's cl100k token count")
        crc = zlib.crc32(counts.to_numpy().tobytes(), crc)
        if filt:
            count_values(table, filt.column, values)
            mask = matches(table.column(filt.column), filt.patterns)
            counts = pc.filter(counts, mask)
        groups.append([first, rows, len(counts), int(pc.sum(counts).as_py() or 0)])
        first += rows
    return {"row_groups": groups, "text_nulls": _footer_nulls(pf, text_column), "counts_crc": crc,
            "values": [[v, *c] for v, c in values.items()] if filt else None}


def _footer_nulls(pf: pq.ParquetFile, text_column: str) -> list[list[int]]:
    """``[row group, nulls]`` of the text column where the footer's statistics count any (no text read;
    a writer without statistics leaves it to the reader's row-level check)."""
    col = pf.schema_arrow.get_field_index(text_column)
    out = []
    for i in range(pf.num_row_groups):
        stats = pf.metadata.row_group(i).column(col).statistics
        if stats is not None and stats.has_null_count and stats.null_count > 0:
            out.append([i, int(stats.null_count)])
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


def _stems(paths: list[str]) -> dict[str, str]:
    """File stem as the doc-ID prefix; qualified by the parent folder(s) where stems collide."""
    by_stem: dict[str, list[str]] = {}
    for p in paths:
        by_stem.setdefault(Path(p).stem, []).append(p)
    out = {}
    for stem, group in by_stem.items():
        if len(group) == 1:
            out[group[0]] = stem
            continue
        common = os.path.commonpath([os.path.abspath(p) for p in group])
        for p in group:
            out[p] = str(Path(os.path.relpath(os.path.abspath(p), common)).with_suffix(""))
    return out


def build_manifest(cfg: DataConfig) -> Manifest:
    """Scan (or load from cache) every configured file; validate; cut sources into chunks.

    Every rank of a job starts here at once: the build holds an exclusive lock on the cache, so one
    process scans (and samples token counts) and the others then find everything in its cache -- the
    cold work happens once per job, not once per rank."""
    with _cache_lock(_cache_dir(cfg) / f"manifest-v{MANIFEST_VERSION}.json"):
        return _build_manifest(cfg)


def _build_manifest(cfg: DataConfig) -> Manifest:
    """The build in its steps: list the files, scan them (through the cache), refuse or skip the bad
    ones, cut each source into chunks, check token_count on a sample; the cache is saved at the end."""
    needed = _needed_columns(cfg)
    files_per_source = _list_files(cfg)
    cache_path = _cache_dir(cfg) / f"manifest-v{MANIFEST_VERSION}.json"
    cache = _load_cache(cache_path)
    scan = _scan_all(cfg, files_per_source, needed, cache)
    null_texts = _check_bad_files(cfg, scan)
    shards, sources, mapping = _cut_sources(cfg, files_per_source, scan)
    problems = _check_token_counts(cfg, files_per_source, scan, sources, shards, cache)
    if scan.dirty:
        _save_cache(cache_path, cache)
    if problems:
        raise ConfigError("\n".join(problems))
    return Manifest(shards=shards, sources=sources, skipped=scan.bad, null_texts=null_texts, mapping=mapping)


@dataclass
class _Scan:
    """What scanning the configured files gave: each (source, path)'s cache key and entry, the bad files."""

    digests: dict[str, str]  # path -> footer digest
    keys: dict[tuple[str, str], str] = field(default_factory=dict)  # (source, path) -> cache key (good files)
    scanned: dict[tuple[str, str], dict] = field(default_factory=dict)  # (source, path) -> cache entry
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    dirty: bool = False  # the cache gained entries: save it


def _needed_columns(cfg: DataConfig) -> dict[str, str]:
    """The Dolma3 columns plus the configured text and id columns, with their Arrow types."""
    needed = dict(SCHEMA)
    needed[cfg.text_column] = "string"
    if cfg.id_column:
        needed[cfg.id_column] = "string"
    return needed


def _list_files(cfg: DataConfig) -> dict[str, list[str]]:
    """Each source's files, each file once under one spelling (:func:`_one_claim_per_file`); refuses a
    source whose globs match nothing and an incomplete global shuffle."""
    files_per_source = {name: src.files() for name, src in cfg.sources.items()}
    empty = [f"data.sources.{name}.paths {cfg.sources[name].paths}: {no_match_reason(cfg.sources[name].paths)}"
             for name, files in files_per_source.items() if not files]
    if empty:
        raise ConfigError("no input files:\n  " + "\n  ".join(empty))
    files_per_source = _one_claim_per_file(cfg, files_per_source)
    incomplete = shuffle_problems(sorted({p for files in files_per_source.values() for p in files}))
    if incomplete:
        raise ConfigError("\n".join(incomplete))
    return files_per_source


def _one_claim_per_file(cfg: DataConfig, files_per_source: dict[str, list[str]]) -> dict[str, list[str]]:
    """A file is the file, not its spelling (:func:`file_identity`): the globs of one source that meet on a
    file (overlapping globs, a relative and an absolute path, a symlinked folder) read it once, under the
    first of its spellings; a file two sources claim is refused unless every claim is a filter (whose
    values the mapping report keeps apart)."""
    spelling: dict[tuple[int, int], str] = {}
    for path in sorted({p for files in files_per_source.values() for p in files}):
        spelling.setdefault(file_identity(path), path)
    out = {name: sorted({spelling[file_identity(p)] for p in files}) for name, files in files_per_source.items()}
    claims: dict[str, list[str]] = {}
    for name, files in out.items():
        for path in files:
            claims.setdefault(path, []).append(name)
    twice = [(p, names) for p, names in claims.items()
             if len(names) > 1 and any(cfg.sources[n].filter is None for n in names)]
    if twice:
        path, names = twice[0]
        who = " and ".join(f"data.sources.{n}.paths {_glob_of(cfg, n, path)!r}" for n in names)
        raise ConfigError(f"{who} both claim {path}{f' (and {len(twice) - 1} more file(s))' if len(twice) > 1 else ''}"
                          ": its documents would be trained once per source; narrow the globs so that each file "
                          "belongs to one source (or give every source reading it a filter)")
    return out


def _glob_of(cfg: DataConfig, name: str, path: str) -> str:
    """The first of source ``name``'s globs that matches ``path``'s file (for naming a claim)."""
    target = file_identity(path)
    return next(g for g in cfg.sources[name].paths
                if any(file_identity(p) == target for p in SourceConfig(paths=[g]).files()))


def _scan_all(cfg: DataConfig, files_per_source: dict[str, list[str]], needed: dict[str, str],
              cache: dict) -> _Scan:
    """Scan every file not in ``cache`` (keyed by path, size, mtime, footer digest, filter and columns)."""
    all_paths = sorted({p for files in files_per_source.values() for p in files})
    with ThreadPoolExecutor(max(1, min(len(all_paths), SCAN_THREADS))) as pool:  # footers only: cheap
        scan = _Scan(digests=dict(zip(all_paths, pool.map(file_digest, all_paths))))
    todo: dict[str, tuple[str, FilterConfig | None]] = {}  # cache key -> (path, filter) to scan
    for name, files in files_per_source.items():
        filt = cfg.sources[name].filter
        fkey = json.dumps([filt.column, filt.patterns]) if filt else ""
        for path in files:
            st = os.stat(path)
            key = (f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{scan.digests[path]}|{fkey}|"
                   f"{sorted(needed.items())}")
            scan.keys[(name, path)] = key
            if key not in cache:
                todo[key] = (path, filt)
    errors = _scan_into(cache, todo, needed, cfg.text_column)
    scan.dirty = len(errors) < len(todo)
    for (name, path), key in list(scan.keys.items()):
        if key in errors:
            scan.bad.append((path, errors[key]))
            del scan.keys[(name, path)]
        else:
            scan.scanned[(name, path)] = cache[key]
    scan.bad = list(dict.fromkeys(scan.bad))  # a file several sources read is one bad file
    return scan


def _scan_into(cache: dict, todo: dict[str, tuple[str, FilterConfig | None]], needed: dict[str, str],
               text_column: str) -> dict[str, str]:
    """Scan ``todo`` (cache key -> (path, filter)) into ``cache``; returns the problem per failed key.
    pyarrow reads footers and the small columns without the GIL: threads scale with the cores."""
    def scan_one(item: tuple[str, FilterConfig | None]) -> dict | str:
        try:
            return _scan_file(item[0], needed, item[1], text_column)
        except ValueError as e:
            return str(e)

    with ThreadPoolExecutor(max(1, min(len(todo), SCAN_THREADS))) as pool:
        results = dict(zip(todo, pool.map(scan_one, todo.values())))
    cache.update({key: r for key, r in results.items() if isinstance(r, dict)})
    return {key: r for key, r in results.items() if isinstance(r, str)}


def _check_bad_files(cfg: DataConfig, scan: _Scan) -> dict[str, list[list[int]]]:
    """Warn of null texts; refuse the bad files (``on_bad_shard: error``) or log each skipped one.
    Returns the null-text counts per file."""
    null_texts = {p: e["text_nulls"] for (_, p), e in scan.scanned.items() if e.get("text_nulls")}
    for problem in null_text_problems(null_texts, cfg):
        log.warning("%s", problem)
    if scan.bad and cfg.on_bad_shard == "error":
        raise ConfigError(
            _shared_problem(scan.bad, cfg, len(scan.digests)) + f"{len(scan.bad)} bad input file(s):\n  "
            + "\n  ".join(f"{p}: {why}" for p, why in scan.bad)
            + "\nFix or remove them, or set data.on_bad_shard: skip to leave them out (logged and counted)."
        )
    for p, why in scan.bad:
        log.warning("skipping bad shard %s: %s", p, why)
    return null_texts


def _cut_sources(cfg: DataConfig, files_per_source: dict[str, list[str]],
                 scan: _Scan) -> tuple[list[Shard], dict[str, SourceInfo], MappingReport | None]:
    """The good shards, the mapping report, and each source cut into training and held-out chunks."""
    good_paths = sorted({p for (_, p) in scan.scanned})
    stems = _stems(good_paths)
    index = {p: i for i, p in enumerate(good_paths)}
    crcs = {p: e.get("counts_crc") for (_, p), e in scan.scanned.items()}
    shards = [Shard(p, stems[p], [], f"{scan.digests[p]}:{crcs[p]}") for p in good_paths]
    mapping = _mapping(cfg, files_per_source, scan.scanned)
    sources: dict[str, SourceInfo] = {}
    for name, files in files_per_source.items():
        groups = []  # (shard, first, rows, docs, tokens)
        for path in files:
            entry = scan.scanned.get((name, path))
            if entry is None:
                continue
            shard = index[path]
            shards[shard].row_groups = [(g[0], g[1]) for g in entry["row_groups"]]
            groups.extend((shard, *g) for g in entry["row_groups"] if g[2] > 0)
        sources[name] = _source_info(cfg, name, groups)
    return shards, sources, mapping


def _source_info(cfg: DataConfig, name: str, groups: list[tuple]) -> SourceInfo:
    """One source from its non-empty row groups ``(shard, first, rows, docs, tokens)``: chunks, held-out
    chunks, and the document and token counts left for training."""
    if not groups:
        raise ConfigError(f"data.sources.{name}: no documents (all files bad, empty, or filtered out)")
    if cfg.val_tokens_per_source > 0 and not any(g[4] for g in groups):
        raise ConfigError(f"data.sources.{name}: the token_count column sums to 0 over its "
                          f"{sum(g[3] for g in groups):,} document(s), so no tokens can be held out "
                          "(data.val_tokens_per_source); token_count "
                          "must hold each document's cl100k count: recompute it (data/tokenizer.py count_tokens)")
    chunks, docs_of, tokens_of = _cut_chunks(groups, cfg.min_chunks_per_source)
    train, val = _hold_out(chunks, tokens_of, cfg.val_tokens_per_source, name)
    tokens = sum(g[4] for g in groups)
    docs = sum(g[3] for g in groups)  # exact per row group (the filter was applied in the scan)
    if val:  # token and (with a filter) doc counts per chunk are estimated pro rata within a row group
        tokens -= sum(tokens_of[c] for c in val)
        docs -= sum(docs_of[c] for c in val)
    return SourceInfo(
        name=name,
        filter=cfg.sources[name].filter,
        chunks=train,
        val_chunks=val,
        docs=int(docs),
        tokens=int(tokens),
        shards=sorted({g[0] for g in groups}),
    )


def _check_token_counts(cfg: DataConfig, files_per_source: dict[str, list[str]], scan: _Scan,
                        sources: dict[str, SourceInfo], shards: list[Shard], cache: dict) -> list[str]:
    """Each source's token_count sample (cached by its files' keys) and empty-source check: the problems."""
    problems = []
    for name, src in sources.items():
        filt = cfg.sources[name].filter
        skey = "sample|" + hashlib.sha256(json.dumps(
            [name, SAMPLE_ROWS, SAMPLE_SCAN_ROWS, TOKEN_COUNT_RATIO, cfg.text_column,
             sorted(scan.keys[(name, p)] for p in files_per_source[name] if (name, p) in scan.keys)]).encode()
        ).hexdigest()
        outcome = cache.get(skey)
        if outcome is None:
            outcome = _sample_token_counts(name, src, shards, filt, cfg.text_column)
            cache[skey] = outcome
            scan.dirty = True
        if outcome.get("problem"):
            problems.append(outcome["problem"])
        elif src.tokens == 0:
            problems.append(f"data.sources.{name}: all {src.docs:,} document(s) are empty (token_count 0 and empty "
                            f"`{cfg.text_column}` in the sample); it would train on EOT tokens only: fix its files or "
                            "drop the source")
    return problems


def _mapping(cfg: DataConfig, files_per_source: dict[str, list[str]], scanned: dict) -> MappingReport | None:
    """The mapping report of the scanned files (None without any filter); its errors stop the build."""
    if not any(src.filter for src in cfg.sources.values()):
        return None
    values_of = {}
    for (name, path), entry in scanned.items():
        filt = cfg.sources[name].filter
        if filt is not None and entry.get("values") is not None:
            values_of[(path, filt.column)] = {v: [r, t] for v, r, t in entry["values"]}
    good = {name: [p for p in files if (name, p) in scanned] for name, files in files_per_source.items()}
    report = build_mapping(cfg, good, values_of)
    for w in report.warnings:
        log.warning("%s", w)
    if report.errors:
        report_lines = textwrap.indent(report.text(problems=False), "  ")  # continues the problems above it
        raise ConfigError("\n".join(report.errors) + "\n" + report_lines)
    return report


def _shared_problem(bad: list[tuple[str, str]], cfg: DataConfig, n_files: int) -> str:
    """One leading line when every bad file misses the same configured column: the key to fix."""
    problems = {why for _, why in bad}
    if len(problems) != 1 or not next(iter(problems)).startswith("missing column '"):
        return ""
    column = next(iter(problems)).split("'")[1]
    try:
        cols = ", ".join(pq.read_schema(bad[0][0]).names)
    except Exception:  # noqa: BLE001 -- only the hint is lost
        cols = "?"
    where = f"column '{column}' is missing from {len(bad)} of {n_files} input file(s) (their columns: {cols})"
    for key in ("text_column", "id_column"):
        if column == getattr(cfg, key):
            return f"data.{key}: {where}; set data.{key} to the column that holds it\n"
    return f"{where}: every shard needs the Dolma3 columns {', '.join(SCHEMA)}\n"


def null_text_problems(null_texts: dict[str, list[list[int]]], cfg: DataConfig) -> list[str]:
    """One line per file whose footer counts null texts: what the reader will do when it gets there.

    A warning from :func:`build_manifest` (tools that only plan keep working); ``train fit`` refuses
    them at start-up under ``on_bad_shard: error`` (train/cli.py), instead of hours in."""
    out = []
    for path, per_group in sorted(null_texts.items()):
        n = sum(c for _, c in per_group)
        where = ", ".join(f"row group {g}: {c}" for g, c in per_group)
        if cfg.on_bad_shard == "error":
            out.append(f"{path}: column '{cfg.text_column}' has {n} null value(s) ({where}); fix the file, or set "
                       "data.on_bad_shard: skip to leave those rows out (logged and counted)")
        else:
            out.append(f"{path}: column '{cfg.text_column}' has {n} null value(s) ({where}); those rows are left out "
                       "(data.on_bad_shard: skip)")
    return out


def _sample_token_counts(name: str, src: SourceInfo, shards: list[Shard], filt: FilterConfig | None,
                         text_column: str) -> dict:
    """token_count against real cl100k counts on a fixed sample of the source's documents.

    The sample is seeded by the source's name: up to :data:`SAMPLE_ROWS` row groups of its training
    chunks, one document each (more per group when it has fewer), each among the first
    :data:`SAMPLE_SCAN_ROWS` rows of its row group, so the cost is a few small reads whatever the
    row-group size. The whole sample and each file's part of it must be within
    :data:`TOKEN_COUNT_RATIO` (differences of at most :data:`SAMPLE_ROWS` tokens give no verdict).
    Returns ``{"problem": str | None, "rows", "counted", "real"}`` (cached).
    """
    per_file, unreadable = _count_sample(name, src, shards, filt, text_column)
    n, counted, real = (sum(v[i] for v in per_file.values()) for i in range(3))
    problem = _token_count_problem(name, per_file, text_column)
    if unreadable:  # met here, before compute, rather than by a DataLoader worker hours later
        problem = "; ".join(filter(None, [problem, *unreadable]))
    return {"problem": problem, "rows": n, "counted": counted, "real": real}


def _count_sample(name: str, src: SourceInfo, shards: list[Shard], filt: FilterConfig | None,
                  text_column: str) -> tuple[dict[str, list[int]], list[str]]:
    """The sample of :func:`_sample_token_counts`: per file, ``[rows, token_count sum, real count]``; and
    the row groups it could not read (``FILE row group G unreadable (reason)``)."""
    from data.tokenizer import count_tokens

    groups = sorted({(c.shard, next(i for i, (f, n) in enumerate(shards[c.shard].row_groups) if f <= c.start < f + n))
                     for c in src.chunks})
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    picked = [groups[i] for i in rng.permutation(len(groups))[:SAMPLE_ROWS]]
    per_group = -(-SAMPLE_ROWS // len(picked))
    per_file: dict[str, list[int]] = {}  # path -> [rows, counted, real]
    unreadable: list[str] = []
    for shard, rg in sorted(picked):
        path = shards[shard].path
        cols = [text_column, "token_count"] + ([filt.column] if filt else [])
        try:
            pf = pq.ParquetFile(path, buffer_size=1 << 20)
            batch = next(pf.iter_batches(batch_size=SAMPLE_SCAN_ROWS, row_groups=[rg], columns=cols), None)
        except Exception as e:  # noqa: BLE001 -- a corrupt page (ArrowInvalid, OSError, ...)
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            unreadable.append(f"{path}: row group {rg}: unreadable ({reason}; met by the start-up token_count "
                              f"sample of data.sources.{name}); restore or rewrite the file, or remove it from the "
                              "corpus")
            continue
        if batch is None:
            continue
        table = pa.Table.from_batches([batch])
        if filt:
            table = table.filter(matches(table.column(filt.column), filt.patterns))
        if not table.num_rows:
            continue
        rows = sorted(rng.permutation(table.num_rows)[:per_group].tolist())
        texts = _sample_texts(table.column(text_column), rows, path, shards[shard].row_groups[rg][0], text_column)
        acc = per_file.setdefault(path, [0, 0, 0])
        acc[0] += len(rows)
        acc[1] += sum(table.column("token_count").take(rows).to_pylist())
        acc[2] += sum(count_tokens(texts, num_threads=1))
    return per_file, unreadable


def _token_count_problem(name: str, per_file: dict[str, list[int]], text_column: str) -> str | None:
    """The verdict on a sample (per file ``[rows, counted, real]``): None, or the problem naming the worst files."""
    n, counted, real = (sum(v[i] for v in per_file.values()) for i in range(3))
    lo, hi = TOKEN_COUNT_RATIO
    if n and real == 0 and counted > 0:  # token_count 0 as well: the source-wide check names it
        return (f"data.sources.{name}: all {n} sampled document(s) have an empty `{text_column}` (in "
                f"{', '.join(sorted(per_file))}; token_count sums to {counted:,} over them); the source "
                "would train on EOT tokens only: fix its files, data.text_column, or drop the source")

    def off(c: int, r: int) -> bool:  # a difference of a few tokens gives no verdict
        return not lo * r <= c <= hi * r and abs(c - r) > SAMPLE_ROWS

    def ratio(v: list[int]) -> float:
        return v[1] / v[2] if v[2] else math.inf

    # the source's sample as a whole, and each file's share of it (one bad file among many good ones)
    bad_files = [(p, v) for p, v in per_file.items() if off(v[1], v[2])]
    if not bad_files and not off(counted, real):
        return None
    bad_files = sorted(bad_files or per_file.items(), key=lambda kv: abs(math.log(ratio(kv[1]) or 1e-9)),
                       reverse=True)
    where = "; ".join(f"{p}: token_count {v[1]:,} vs {v[2]:,} real over {v[0]} sampled row(s) (x{ratio(v):.3g})"
                      for p, v in bad_files[:3])
    return (f"data.sources.{name}: token_count does not match the text ({where}); the sample of {n} "
            f"row(s) must be within x{lo:g}..x{hi:g} of the real cl100k count: recompute the column with "
            "cl100k_base (data/tokenizer.py count_tokens) or fix the file")


def _sample_texts(column: pa.ChunkedArray, rows: list[int], path: str, first: int, text_column: str) -> list[str]:
    """The sampled texts (null as empty); a text that is not valid UTF-8 is named by file and row."""
    out = []
    for row, value in zip(rows, column.take(rows).cast(pa.large_binary()).to_pylist()):
        try:
            out.append((value or b"").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: row {first + row}: column '{text_column}' is not valid "
                              f"UTF-8 ({e.reason} at byte {e.start}); fix or re-encode the file") from None
    return out


def _cut_chunks(groups: list[tuple], min_chunks: int):
    """Chunks with their doc and token counts (exact per row group, pro rata inside one)."""
    # The same number of parts per row group, the fewest that give min_chunks chunks in all -- a
    # row group cannot be cut finer than one row per chunk, so small groups may need more parts
    # from the big ones (or, when every group is down to single rows, the source has fewer chunks).
    parts = max(1, math.ceil(min_chunks / len(groups)))
    most_rows = max(g[2] for g in groups)
    while parts < most_rows and sum(min(parts, g[2]) for g in groups) < min_chunks:
        parts += 1
    chunks, docs_of, tokens_of = [], {}, {}
    for shard, first, rows, docs, tokens in groups:
        n = min(parts, rows)
        bounds = np.linspace(first, first + rows, n + 1).round().astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            c = Chunk(shard, int(a), int(b))
            chunks.append(c)
            docs_of[c] = round(docs * (b - a) / rows)  # exact without a filter; pro rata with one
            tokens_of[c] = tokens * (b - a) / rows if n > 1 else tokens
    return chunks, docs_of, tokens_of


def _hold_out(chunks: list[Chunk], tokens_of: dict[Chunk, float], want: int, name: str):
    """Chunks for validation: a fixed, seed-independent spread (every arm sees the same val set)."""
    if want <= 0:
        return chunks, []
    order = np.random.default_rng(0).permutation(len(chunks))
    val, have = set(), 0
    for i in order:
        if have >= want:
            break
        val.add(int(i))
        have += tokens_of[chunks[i]]
    if len(val) >= len(chunks):
        raise ConfigError(
            f"data.val_tokens_per_source={want} would hold out all of source '{name}' ({have:.0f} tokens); lower it"
        )
    return [c for i, c in enumerate(chunks) if i not in val], [c for i, c in enumerate(chunks) if i in val]


SCAN_THREADS = min(32, os.cpu_count() or 1)
"""Files scanned at once on a cold manifest build (footers and the filter/token_count columns)."""


@contextlib.contextmanager
def _cache_lock(cache_path: Path):
    """An exclusive ``flock`` on ``<cache>.lock`` for the read-scan-write of the cache. Without lock
    support (some network filesystems) or a writable cache dir, every process scans for itself."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache_path.with_suffix(".lock"), "a+")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _load_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(cache), fsync=False)  # a lost cache only costs a rescan
    except OSError as e:  # a read-only cache dir only costs a rescan next time
        log.warning("could not write manifest cache %s: %s", path, e)
