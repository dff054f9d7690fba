"""The manifest: every shard, row group, row and token count per source -- from metadata, no text read.

Built once at start-up, before any compute, and cached (keyed by each file's path, size and mtime),
so a 20B-token corpus starts in seconds instead of a rescan. Building it is also where bad input
is caught: a missing or empty glob, a missing column, a wrong column type, a truncated or corrupt
file -> one ``ConfigError`` that names every bad file and its problem. With ``on_bad_shard: skip``
bad files are logged, left out and counted in ``Manifest.skipped`` instead.

``token_count`` is checked: a null or negative count makes a bad file, a sample of each source is
counted with ``data.tokenizer`` (data/token_sample.py), a source whose documents are all empty is an error;
with ``data.tokenizer.recount`` the scan counts every text with the tokenizer instead of trusting the column. Null
texts are counted from the footers into ``Manifest.null_texts`` (``train fit`` refuses them unless
``on_bad_shard: skip``). The cache keeps each file's scan and each source's sample outcome, so a cached
start-up re-applies every check without reading text.

A file is the file, not its spelling: the globs of one source that meet on a file read it once; a file
two sources claim is refused unless every source reading it has a filter, and then the mapping report
(data/mapping.py) refuses a pattern that matches nothing, unclaimed values above ``data.unclaimed`` and
a value two sources claim. The fingerprint a checkpoint keeps covers each file's size, footer hash and
``token_count`` checksum, so a file rewritten in place is named at resume, and the tokenizer's identity.
An unverified global-shuffle output is refused (data/shuffled.py).

The unit of splitting is the *chunk*: a row range inside one row group of one shard. A source gets
one chunk per row group, and its row groups are split into equal row ranges until it has at least
``min_chunks_per_source`` chunks, so a 2-shard curated source still spreads over 64 consumers. The
chunking depends on the files only, never on the number of ranks or workers.
"""

from __future__ import annotations

import contextlib
import fcntl
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

from data.config import SCHEMA, DataConfig, FilterConfig
from data.errors import ConfigError
from data.files import file_digest, write_text
from data.mapping import MappingReport, build_mapping, count_values, matches
from data.source_files import doc_id_stems, list_files
from data.token_sample import SAMPLE_ROWS, SAMPLE_SCAN_ROWS, TOKEN_COUNT_RATIO, sample_token_counts
from data.tokenizer import CL100K_IDENTITY, Tokenizer

log = logging.getLogger(__name__)

MANIFEST_VERSION = 3  # bump when the cached entry layout changes (the cache file name carries it)
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
    tokenizer: str = CL100K_IDENTITY  # the identity of the tokenizer that counts and encodes (data/tokenizer.py)

    @property
    def source_names(self) -> list[str]:
        return list(self.sources)

    def fingerprint(self) -> str:
        """Identifies the corpus as the data path sees it: files, row groups, each file's bytes as far as
        its size, parquet footer (every column chunk's offsets, sizes and statistics) and token_count
        column show them, filters and chunking, and the tokenizer (cl100k_base, the default, adds nothing: the
        fingerprints of runs from before the tokenizer was a config key stay as they were)."""
        h = hashlib.sha256(b"" if self.tokenizer == CL100K_IDENTITY else f"tokenizer|{self.tokenizer}\n".encode())
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


def _scan_file(path: str, needed: dict[str, str], filt: FilterConfig | None, text_column: str = "text",
               recount: Tokenizer | None = None) -> dict:
    """Row groups with (rows, matching docs, matching tokens); ``recount``: tokens counted from the text with
    that tokenizer, not taken from the column. Raises ValueError(problem)."""
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
        table = _read_counts(pf, i, cols)
        counts = table.column("token_count")
        crc = zlib.crc32(counts.to_numpy().tobytes(), crc)
        if recount is not None:  # a slice of texts at a time: a row group may hold ~100k documents
            counts = pa.array([n for batch in pf.iter_batches(4096, row_groups=[i], columns=[text_column])
                               for n in recount.count([t or "" for t in batch.column(0).to_pylist()], 1)], pa.int64())
            table = table.set_column(0, "token_count", counts)  # the mapping report's token sums too
        if filt:
            count_values(table, filt.column, values)
            mask = matches(table.column(filt.column), filt.patterns)
            counts = pc.filter(counts, mask)
        groups.append([first, rows, len(counts), int(pc.sum(counts).as_py() or 0)])
        first += rows
    return {"row_groups": groups, "text_nulls": _footer_nulls(pf, text_column), "counts_crc": crc,
            "values": [[v, *c] for v, c in values.items()] if filt else None}


def _read_counts(pf: pq.ParquetFile, i: int, cols: list[str]) -> pa.Table:
    """Row group ``i``'s ``cols``; raises ValueError(problem) when unreadable or token_count is null or negative."""
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
                         f"{pc.min(counts).as_py()}); it must be each document's token count (data.tokenizer)")
    return table


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
    files_per_source = list_files(cfg)
    tokenizer = cfg.tokenizer.build()
    cache_path = _cache_dir(cfg) / f"manifest-v{MANIFEST_VERSION}.json"
    cache = _load_cache(cache_path)
    scan = _scan_all(cfg, files_per_source, needed, cache, tokenizer if cfg.tokenizer.recount else None)
    null_texts = _check_bad_files(cfg, scan)
    shards, sources, mapping = _cut_sources(cfg, files_per_source, scan)
    problems = _check_token_counts(cfg, files_per_source, scan, sources, shards, cache, tokenizer)
    if scan.dirty:
        _save_cache(cache_path, cache)
    if problems:
        raise ConfigError("\n".join(problems))
    return Manifest(shards=shards, sources=sources, skipped=scan.bad, null_texts=null_texts, mapping=mapping,
                    tokenizer=tokenizer.identity)


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


def _scan_all(cfg: DataConfig, files_per_source: dict[str, list[str]], needed: dict[str, str],
              cache: dict, recount: Tokenizer | None) -> _Scan:
    """Scan every file not in ``cache`` (keyed by path, size, mtime, footer digest, filter and columns, and the
    tokenizer that ``recount`` counts the texts with)."""
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
                   f"{sorted(needed.items())}" + (f"|recount {recount.identity}" if recount else ""))
            scan.keys[(name, path)] = key
            if key not in cache:
                todo[key] = (path, filt)
    errors = _scan_into(cache, todo, needed, cfg.text_column, recount)
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
               text_column: str, recount: Tokenizer | None) -> dict[str, str]:
    """Scan ``todo`` (cache key -> (path, filter)) into ``cache``; returns the problem per failed key.
    pyarrow reads footers and the small columns without the GIL: threads scale with the cores."""
    def scan_one(item: tuple[str, FilterConfig | None]) -> dict | str:
        try:
            return _scan_file(item[0], needed, item[1], text_column, recount)
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
    stems = doc_id_stems(good_paths)
    index = {p: i for i, p in enumerate(good_paths)}
    crcs = {p: e.get("counts_crc") for (_, p), e in scan.scanned.items()}
    shards = [Shard(p, stems[p], [], f"{scan.digests[p]}:{crcs[p]}") for p in good_paths]
    mapping = _mapping(cfg, files_per_source, scan.scanned)
    for (_, path), entry in scan.scanned.items():
        shards[index[path]].row_groups = [(g[0], g[1]) for g in entry["row_groups"]]
    sources = {name: _source_info(cfg, name, _groups(scan.scanned, name, files, index))
               for name, files in files_per_source.items()}
    return shards, sources, mapping


def _groups(scanned: dict, name: str, files: list[str], index: dict[str, int]) -> list[tuple]:
    """Source ``name``'s non-empty row groups ``(shard, first, rows, docs, tokens)``, in file order."""
    return [(index[p], *g) for p in files if (name, p) in scanned for g in scanned[(name, p)]["row_groups"] if g[2]]


def _source_info(cfg: DataConfig, name: str, groups: list[tuple]) -> SourceInfo:
    """One source from its non-empty row groups ``(shard, first, rows, docs, tokens)``: chunks, held-out
    chunks, and the document and token counts left for training."""
    _refuse_empty(cfg, name, groups)
    chunks, docs_of, tokens_of = _cut_chunks(groups, cfg.min_chunks_per_source)
    train, val = _hold_out(chunks, tokens_of, cfg.val_tokens_per_source, name)
    # exact per row group (the filter was applied in the scan); the held-out chunks' token and (with a
    # filter) doc counts are estimated pro rata within a row group
    tokens = sum(g[4] for g in groups) - sum(tokens_of[c] for c in val)
    docs = sum(g[3] for g in groups) - sum(docs_of[c] for c in val)
    return SourceInfo(
        name=name,
        filter=cfg.sources[name].filter,
        chunks=train,
        val_chunks=val,
        docs=int(docs),
        tokens=int(tokens),
        shards=sorted({g[0] for g in groups}),
    )


def _refuse_empty(cfg: DataConfig, name: str, groups: list[tuple]) -> None:
    """A source without documents, or without tokens to hold out, is refused."""
    if not groups:
        raise ConfigError(f"data.sources.{name}: no documents (all files bad, empty, or filtered out)")
    if cfg.val_tokens_per_source > 0 and not sum(g[4] for g in groups):
        raise ConfigError(f"data.sources.{name}: the token_count column sums to 0 over its "
                          f"{sum(g[3] for g in groups):,} document(s), so no tokens can be held out "
                          "(data.val_tokens_per_source); token_count "
                          "must hold each document's token count: recompute it (or set data.tokenizer.recount true)")


def _check_token_counts(cfg: DataConfig, files_per_source: dict[str, list[str]], scan: _Scan,
                        sources: dict[str, SourceInfo], shards: list[Shard], cache: dict,
                        tokenizer: Tokenizer) -> list[str]:
    """Each source's token_count sample (cached by its files' keys and the tokenizer; none when the scan
    recounted the column) and empty-source check: the problems."""
    problems = []
    for name, src in sources.items():
        filt = cfg.sources[name].filter
        skey = "sample|" + hashlib.sha256(json.dumps(
            [name, SAMPLE_ROWS, SAMPLE_SCAN_ROWS, TOKEN_COUNT_RATIO, cfg.text_column, tokenizer.identity,
             sorted(scan.keys[(name, p)] for p in files_per_source[name] if (name, p) in scan.keys)]).encode()
        ).hexdigest()
        outcome = {} if cfg.tokenizer.recount else cache.get(skey)
        if outcome is None:
            outcome = sample_token_counts(name, _row_groups(src, shards), filt, cfg.text_column, tokenizer)
            cache[skey] = outcome
            scan.dirty = True
        if outcome.get("problem"):
            problems.append(outcome["problem"])
        elif src.tokens == 0:
            problems.append(f"data.sources.{name}: all {src.docs:,} document(s) are empty (token_count 0 and empty "
                            f"`{cfg.text_column}` in the sample); it would train on EOT tokens only: fix its files or "
                            "drop the source")
    return problems


def _row_groups(src: SourceInfo, shards: list[Shard]) -> list[tuple[str, int, int]]:
    """``(path, row group, first row)`` of every row group holding a training chunk of ``src``, sorted."""
    out = set()
    for c in src.chunks:
        rg = next(i for i, (f, n) in enumerate(shards[c.shard].row_groups) if f <= c.start < f + n)
        out.add((shards[c.shard].path, rg, shards[c.shard].row_groups[rg][0]))
    return sorted(out)


def _mapping(cfg: DataConfig, files_per_source: dict[str, list[str]], scanned: dict) -> MappingReport | None:
    """The mapping report of the scanned files (None without any filter); its errors stop the build."""
    if not any(src.filter for src in cfg.sources.values()):
        return None
    good = {name: [p for p in files if (name, p) in scanned] for name, files in files_per_source.items()}
    report = build_mapping(cfg, good, _values_of(cfg, scanned))
    for w in report.warnings:
        log.warning("%s", w)
    if report.errors:
        report_lines = textwrap.indent(report.text(problems=False), "  ")  # continues the problems above it
        raise ConfigError("\n".join(report.errors) + "\n" + report_lines)
    return report


def _values_of(cfg: DataConfig, scanned: dict) -> dict[tuple[str, str], dict]:
    """``(path, filter column) -> value -> [rows, tokens]`` of the files the filtered sources read."""
    return {(path, cfg.sources[name].filter.column): {v: [r, t] for v, r, t in entry["values"]}
            for (name, path), entry in scanned.items() if entry.get("values") is not None}


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
