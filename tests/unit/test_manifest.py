"""Corpus config and validation (issue 2, section 4): bad input is refused at start-up with one clear
error naming the file and the problem; the manifest is cached; row filters, chunking, the validation
hold-out and document IDs.

Everything runs the real ``build_manifest`` on small real parquet files: copies of demo shards, and
files written here in the Dolma3 schema with true cl100k token counts.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.manifest as manifest_mod
from data.config import DataConfig, FilterConfig, SourceConfig
from data.errors import ConfigError
from data.manifest import build_manifest
from data.reader import ShardReader
from data.schedules import fixed_schedule
from data.simulate import OrderSimulator
from data.tokenizer import TokenizerConfig, cl100k_encoding

count_tokens = TokenizerConfig().build().count

# -- helpers ------------------------------------------------------------------------------------


def write_shard(path: Path, rows: list[tuple[str, str]], row_group_size: int = 8, **columns) -> Path:
    """A Dolma3-schema parquet file from (sub-source, text) rows; ``columns`` replace whole columns."""
    texts = [t for _, t in rows]
    table = {
        "source": pa.array([s for s, _ in rows], pa.string()),
        "date": pa.array(["2024-01-01"] * len(rows), pa.string()),
        "text": pa.array(texts, pa.string()),
        "token_count": pa.array(count_tokens(texts), pa.int64()),
        "category": pa.array([s.split("_")[0] for s, _ in rows], pa.string()),
    }
    for name, value in columns.items():
        if value is None:
            del table[name]
        else:
            table[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path, row_group_size=row_group_size)
    return path


def texts(prefix: str, n: int) -> list[tuple[str, str]]:
    return [(prefix, f"{prefix} document {i}: " + "lorem ipsum dolor " * (1 + i % 5)) for i in range(n)]


def one_source_cfg(tmp_path: Path, *patterns: str, seq_len: int = 2048, **kw) -> DataConfig:
    """A single-source config over the given globs (a fixed mixture at ``seq_len``), with its own manifest cache."""
    kw.setdefault("manifest_cache", str(tmp_path / "cache"))
    return DataConfig(sources={"web": SourceConfig(paths=list(patterns))},
                      schedule=fixed_schedule({"web": 1.0}, seq_len), **kw)


@pytest.fixture
def good_dir(tmp_path, demo_corpus) -> Path:
    """Two real demo shards (curated: 4 row groups each) copied into tmp_path/corpus."""
    out = tmp_path / "corpus"
    out.mkdir()
    for src in sorted((demo_corpus / "curated").glob("*.parquet")):
        shutil.copy(src, out / src.name)
    return out


def overwrite(path: Path, offset: int, n: int = 64) -> None:
    """Clobber n bytes at offset with 0xFF (a page header that no longer parses); footer untouched."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * n)


def column_chunk_start(path: Path, row_group: int, column: str) -> int:
    meta = pq.ParquetFile(path).metadata.row_group(row_group)
    for j in range(meta.num_columns):
        col = meta.column(j)
        if col.path_in_schema == column:
            return col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    raise KeyError(column)


# -- missing and bad input ----------------------------------------------------------------------


def test_glob_matching_nothing_names_every_source_key(tmp_path, good_dir):
    """Guards: a typo in a glob silently training on fewer sources (or failing late, mid-run).
    Every empty source is named by its config key in the one error."""
    cfg = DataConfig(
        sources={
            "web": SourceConfig(paths=[str(good_dir / "*.parquet")]),
            "code": SourceConfig(paths=[str(tmp_path / "nope" / "*.parquet")]),
            "books": SourceConfig(paths=[str(tmp_path / "typo*.parquet")]),
        },
        schedule=fixed_schedule({"web": 0.5, "code": 0.25, "books": 0.25}, 2048),
        manifest_cache=str(tmp_path / "cache"),
    )
    with pytest.raises(ConfigError) as err:
        build_manifest(cfg)
    msg = str(err.value)
    assert "data.sources.code.paths" in msg and "data.sources.books.paths" in msg
    assert "data.sources.web" not in msg
    assert "no file matches" in msg


def _bad_files(tmp_path: Path, demo_corpus: Path) -> dict[str, tuple[Path, str]]:
    """One file per kind of bad input -> (path, a phrase the error must carry for it)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    rows = texts("web_a", 12)
    real = sorted((demo_corpus / "web").glob("*.parquet"))[0]
    truncated = bad / "truncated.parquet"
    data = real.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    not_parquet = bad / "notes.parquet"
    not_parquet.write_text("source,text\nweb,hello\n")
    random_bytes = bad / "random.parquet"
    random_bytes.write_bytes(os.urandom(4096))
    corrupt_rg = bad / "corrupt_rg.parquet"
    shutil.copy(real, corrupt_rg)
    overwrite(corrupt_rg, column_chunk_start(corrupt_rg, 1, "token_count"))
    return {
        "missing": (write_shard(bad / "no_token_count.parquet", rows, token_count=None),
                    "missing column 'token_count'"),
        "tc_str": (write_shard(bad / "tc_as_string.parquet", rows, token_count=pa.array(["1"] * 12)),
                   "column 'token_count' has type string, expected int64"),
        "text_int": (write_shard(bad / "text_as_int.parquet", rows, text=pa.array(range(12), pa.int64())),
                     "column 'text' has type int64, expected string"),
        "truncated": (truncated, "not a readable parquet file"),
        "not_parquet": (not_parquet, "not a readable parquet file"),
        "random": (random_bytes, "not a readable parquet file"),
        "corrupt_rg": (corrupt_rg, "row group 1 unreadable"),
    }


def test_an_unset_variable_in_a_path_is_named_as_such(tmp_path, good_dir, monkeypatch):
    """'$DOLMA3_DIR/**/*.parquet' with DOLMA3_DIR unset: the error names the variable, not only the glob."""
    monkeypatch.delenv("WELLMIXED_TEST_UNSET_DIR", raising=False)
    cfg = DataConfig(
        sources={"web": SourceConfig(paths=[str(good_dir / "*.parquet")]),
                 "code": SourceConfig(paths=["$WELLMIXED_TEST_UNSET_DIR/**/*.parquet"])},
        schedule=fixed_schedule({"web": 0.5, "code": 0.5}, 2048), manifest_cache=str(tmp_path / "cache"),
    )
    with pytest.raises(ConfigError) as err:
        build_manifest(cfg)
    msg = str(err.value)
    assert "data.sources.code.paths" in msg and "$WELLMIXED_TEST_UNSET_DIR is not set" in msg
    assert "export WELLMIXED_TEST_UNSET_DIR=" in msg and "data.sources.web" not in msg


def test_every_bad_file_is_listed_in_one_error(tmp_path, demo_corpus, good_dir):
    """Guards: fixing bad shards one restart at a time (only the first reported), and errors that
    name neither the file nor the problem. Missing column, wrong column types, truncated, random
    bytes, a text file, and a corrupt row group behind an intact footer: one ConfigError, each file
    on its own line with its problem, raised by build_manifest before any compute."""
    bad = _bad_files(tmp_path, demo_corpus)
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    cfg.sources["web"].paths.append(str(tmp_path / "bad" / "*.parquet"))
    with pytest.raises(ConfigError) as err:
        build_manifest(cfg)
    msg = str(err.value)
    assert f"{len(bad)} bad input file(s)" in msg
    lines = msg.splitlines()
    for kind, (path, phrase) in bad.items():
        line = [ln for ln in lines if str(path) in ln]
        assert len(line) == 1, (kind, msg)
        assert phrase in line[0], (kind, line[0])
    for good in good_dir.glob("*.parquet"):
        assert str(good) not in msg
    assert "on_bad_shard: skip" in msg  # says how to opt out
    # nothing bad was cached: a second run reports the same files again
    with pytest.raises(ConfigError, match=f"{len(bad)} bad input file"):
        build_manifest(cfg)


@pytest.mark.parametrize("kind", ["missing", "tc_str", "text_int", "truncated", "not_parquet", "random", "corrupt_rg"])
def test_each_bad_file_alone_gets_its_error(tmp_path, demo_corpus, kind):
    """Each kind of bad input on its own (so one kind cannot hide behind another's message)."""
    path, phrase = _bad_files(tmp_path, demo_corpus)[kind]
    with pytest.raises(ConfigError) as err:
        build_manifest(one_source_cfg(tmp_path, str(path)))
    assert str(path) in str(err.value) and phrase in str(err.value)


def test_corrupt_text_column_is_caught_at_start_up_or_by_the_reader_naming_the_file(tmp_path, good_dir):
    """The manifest reads metadata, token counts and the token_count sample's pages (no full text
    scan, so a 20B corpus starts in seconds): a corrupt text page the sample reads is refused at
    start-up, naming file and row group. A page that goes bad after the manifest was built is named by
    the ShardReader the moment that row group is read -- never silently wrong text. Other row groups
    still read."""
    path = sorted(good_dir.glob("*.parquet"))[0]
    cfg = one_source_cfg(tmp_path, str(path), min_chunks_per_source=1)
    m = build_manifest(cfg)
    original = path.read_bytes()
    overwrite(path, column_chunk_start(path, 1, "text"))
    reader = ShardReader(m, cfg)
    chunks = m.sources["web"].chunks
    first, rows = m.shards[0].row_groups[1]
    in_rg1 = [c for c in chunks if c.start == first]
    in_rg0 = [c for c in chunks if c.start == 0]
    reader.read_chunk(0, in_rg0[0])
    with pytest.raises(RuntimeError) as err:
        reader.read_chunk(0, in_rg1[0])
    assert str(path) in str(err.value) and "row group 1" in str(err.value)

    fresh = one_source_cfg(tmp_path / "fresh", str(path), min_chunks_per_source=1)  # no cached manifest
    with pytest.raises(ConfigError, match=rf"{path}: row group 1: unreadable \(.*start-up token_count sample"):
        build_manifest(fresh)
    path.write_bytes(original)


def test_null_token_count_is_refused(tmp_path):
    """Guards: a null token_count turning into 0 tokens and skewing the mixture plan."""
    path = write_shard(tmp_path / "nulls.parquet", texts("web_a", 4),
                       token_count=pa.array([5, None, 7, 9], pa.int64()))
    with pytest.raises(ConfigError, match="null"):
        build_manifest(one_source_cfg(tmp_path, str(path)))


def test_on_bad_shard_skip_logs_counts_and_keeps_going(tmp_path, demo_corpus, good_dir, caplog):
    """Guards: `skip` silently dropping data. Each skipped file is logged with its problem and
    counted in manifest.skipped (and the summary); the good files stream as usual."""
    bad = _bad_files(tmp_path, demo_corpus)
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"), str(tmp_path / "bad" / "*.parquet"),
                         on_bad_shard="skip", batch_size=2, seq_len=64, buffer_size=8, open_shards=2)
    with caplog.at_level(logging.WARNING, logger="data.manifest"):
        m = build_manifest(cfg)
    assert sorted(p for p, _ in m.skipped) == sorted(str(p) for p, _ in bad.values())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for path, phrase in bad.values():
        assert str(path) in logged
    assert f"skipped {len(bad)} bad file(s)" in m.summary()
    good = sorted(good_dir.glob("*.parquet"))
    assert [s.path for s in m.shards] == [str(p) for p in good]
    assert m.sources["web"].docs == sum(pq.ParquetFile(p).metadata.num_rows for p in good)
    stems = {p.stem for p in good}
    lines = list(OrderSimulator(m, cfg, 1, 1).order_lines(3))
    assert all(piece[0].split(":")[0] in stems for line in lines for piece in line["pieces"])


def test_skip_with_every_file_bad_is_still_an_error(tmp_path, demo_corpus):
    """Guards: `skip` turning an all-bad source into an empty one (a mixer that can never draw it)."""
    _bad_files(tmp_path, demo_corpus)
    cfg = one_source_cfg(tmp_path, str(tmp_path / "bad" / "*.parquet"), on_bad_shard="skip")
    with pytest.raises(ConfigError, match="data.sources.web: no documents"):
        build_manifest(cfg)


# -- the manifest cache -------------------------------------------------------------------------


@pytest.fixture
def scan_calls(monkeypatch) -> list[str]:
    """Paths passed to data.manifest._scan_file (the real one still runs)."""
    calls: list[str] = []
    real = manifest_mod._scan_file

    def counting(path, *args, **kw):
        calls.append(path)
        return real(path, *args, **kw)

    monkeypatch.setattr(manifest_mod, "_scan_file", counting)
    return calls


def test_cache_reused_while_files_unchanged(tmp_path, good_dir, scan_calls):
    """Guards: rescanning a 20B-token corpus on every start. An unchanged file is not opened again,
    and the cached manifest is the manifest a fresh scan gives."""
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    first = build_manifest(cfg)
    assert len(scan_calls) == 2
    scan_calls.clear()
    second = build_manifest(cfg)
    assert scan_calls == []
    assert second.fingerprint() == first.fingerprint()
    assert second.sources["web"].chunks == first.sources["web"].chunks
    a, b = first.sources["web"], second.sources["web"]
    assert (b.docs, b.tokens) == (a.docs, a.tokens)


def test_touched_or_changed_file_is_rescanned_alone(tmp_path, scan_calls):
    """Guards: a stale cache after a file is re-downloaded or rewritten (same path, new content).
    A new mtime rescans that file only; new content (new size) shows up in the manifest."""
    a = write_shard(tmp_path / "c" / "a.parquet", texts("web_a", 10))
    b = write_shard(tmp_path / "c" / "b.parquet", texts("web_b", 10))
    cfg = one_source_cfg(tmp_path, str(tmp_path / "c" / "*.parquet"), min_chunks_per_source=1)
    assert build_manifest(cfg).sources["web"].docs == 20
    assert sorted(scan_calls) == [str(a), str(b)]

    scan_calls.clear()
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    build_manifest(cfg)
    assert scan_calls == [str(a)]

    scan_calls.clear()
    write_shard(b, texts("web_b", 17))  # same path, more rows
    m = build_manifest(cfg)
    assert scan_calls == [str(b)]
    assert m.sources["web"].docs == 27
    assert m.shards[1].row_groups == [(0, 8), (8, 8), (16, 1)]

    scan_calls.clear()
    build_manifest(cfg)
    assert scan_calls == []


def test_cache_written_atomically_and_bad_cache_ignored(tmp_path, good_dir):
    """Guards: a half-written cache file (a crash, or two ranks starting at once) breaking the next
    start. The cache is replaced atomically (no temp files left), and an unreadable cache only
    costs a rescan."""
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    fp = build_manifest(cfg).fingerprint()
    cache = Path(cfg.manifest_cache)
    name = f"manifest-v{manifest_mod.MANIFEST_VERSION}"
    assert sorted(p.name for p in cache.iterdir()) == [f"{name}.json", f"{name}.lock"]  # the lock file stays
    cache_file = cache / f"{name}.json"
    cache_file.write_text(cache_file.read_text()[:100])  # truncated JSON
    assert build_manifest(cfg).fingerprint() == fp
    assert sorted(p.name for p in cache.iterdir()) == [f"{name}.json", f"{name}.lock"]


def test_processes_starting_at_once_scan_each_file_once(tmp_path, good_dir, monkeypatch):
    """Every rank of a job builds the manifest at the same moment: one scans (in parallel threads), the
    others wait on the cache lock and read what it wrote -- each file is scanned once per job."""
    import threading
    import time

    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    scans: list[str] = []
    real_scan = manifest_mod._scan_file

    def slow_scan(path, *args):
        scans.append(path)
        time.sleep(0.05)  # a cold read on a shared filesystem
        return real_scan(path, *args)

    monkeypatch.setattr(manifest_mod, "_scan_file", slow_scan)
    prints: list[str] = []
    # flock conflicts between separate open() calls even within one process: threads stand in for ranks
    ranks = [threading.Thread(target=lambda: prints.append(build_manifest(cfg).fingerprint())) for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    files = sorted(str(p) for p in good_dir.glob("*.parquet"))
    assert sorted(scans) == files  # once each, not once per rank
    assert len(prints) == 4 and len(set(prints)) == 1


# -- row filters: several mixture sources over the same files ----------------------------------

SUBSOURCES = ["wiki_en", "wikibooks", "arxiv_2023", "cc_en_head", "cc_en_tail", "stack_code"]
FILTERS = {"curated": ["wiki*", "arxiv*"], "web": ["cc_*"]}  # stack_code belongs to neither


@pytest.fixture
def mixed_corpus(tmp_path) -> list[Path]:
    """Three files whose rows interleave six sub-sources (like dolma3_300B_sample_shuffled)."""
    paths = []
    for f in range(3):
        rows = []
        for i in range(29 + 5 * f):
            sub = SUBSOURCES[(i * 7 + f) % len(SUBSOURCES)]
            rows.append((sub, f"[{sub} f{f} r{i}] " + "the quick brown fox " * (1 + (i * 3 + f) % 7)))
        paths.append(write_shard(tmp_path / "mixed" / f"part-{f}.parquet", rows, row_group_size=8))
    return paths


def _filtered_cfg(tmp_path, paths, filters=FILTERS, **kw) -> DataConfig:
    sources = {
        name: SourceConfig(paths=[str(p) for p in paths], filter=FilterConfig(column="source", values=pats))
        for name, pats in filters.items()
    }
    weights = {name: 1 / len(filters) for name in filters}
    kw.setdefault("unclaimed", 1.0)  # stack_code is left out on purpose
    return DataConfig(sources=sources, schedule=fixed_schedule(weights, 2048), manifest_cache=str(tmp_path / "cache"),
                      **kw)


def _hand_count(paths, patterns) -> dict[tuple[str, int], tuple[str, int]]:
    """(path, row) -> (text, token_count) of the rows whose sub-source matches a pattern."""
    import fnmatch

    out = {}
    for p in paths:
        t = pq.read_table(p).to_pylist()
        for row, r in enumerate(t):
            if any(fnmatch.fnmatchcase(r["source"], pat) for pat in patterns):
                out[(str(p), row)] = (r["text"], r["token_count"])
    return out


@pytest.mark.parametrize("min_chunks", [1, 16])  # 16: row groups are cut into row ranges
def test_filter_counts_and_streams_exactly_the_matching_rows(tmp_path, mixed_corpus, min_chunks):
    """Guards: a filter applied in the manifest but not in the reader (or the other way round),
    fnmatch patterns treated as literals or substrings, two sources over the same file sharing
    rows, and pro-rata document counts. Docs and tokens per source equal a hand count; reading
    every chunk yields exactly the matching rows of each source, each once, with their text."""
    cfg = _filtered_cfg(tmp_path, mixed_corpus, min_chunks_per_source=min_chunks)
    m = build_manifest(cfg)
    reader = ShardReader(m, cfg)
    enc = cl100k_encoding()
    seen: dict[str, Counter] = {}
    for idx, (name, patterns) in enumerate(FILTERS.items()):
        want = _hand_count(mixed_corpus, patterns)
        info = m.sources[name]
        assert info.docs == len(want)
        assert info.tokens == sum(n for _, n in want.values())
        got: Counter = Counter()
        for chunk in info.chunks:
            rows, tokens = reader.read_chunk(idx, chunk)
            for row, toks in zip(rows, tokens):
                key = (m.shards[chunk.shard].path, row)
                got[key] += 1
                text, n = want[key]
                assert len(toks) == n + 1 and enc.decode(toks[:-1].tolist()) == text
        assert set(got) == set(want) and max(got.values()) == 1
        seen[name] = got
    assert not set(seen["curated"]) & set(seen["web"])
    # rows of neither source (stack_code) are never read
    stack = _hand_count(mixed_corpus, ["stack_code"])
    assert stack and not set(stack) & (set(seen["curated"]) | set(seen["web"]))


def test_filter_change_is_not_served_from_the_cache(tmp_path, mixed_corpus):
    """Guards: a cache keyed on the file alone returning another filter's counts."""
    m1 = build_manifest(_filtered_cfg(tmp_path, mixed_corpus))
    narrower = {"curated": ["wiki_en"], "web": ["cc_en_head"]}
    m2 = build_manifest(_filtered_cfg(tmp_path, mixed_corpus, filters=narrower))
    for name, pats in narrower.items():
        assert m2.sources[name].docs == len(_hand_count(mixed_corpus, pats)) < m1.sources[name].docs


def test_filter_on_category_column(tmp_path, mixed_corpus):
    """The filter's other column: Dolma3's `category` (here the sub-source's first word)."""
    cfg = DataConfig(
        sources={"cc": SourceConfig(paths=[str(p) for p in mixed_corpus],
                                    filter=FilterConfig(column="category", values=["cc"]))},
        schedule=fixed_schedule({"cc": 1.0}, 2048), manifest_cache=str(tmp_path / "cache"),
        unclaimed=1.0,  # the rest left out
    )
    assert build_manifest(cfg).sources["cc"].docs == len(_hand_count(mixed_corpus, ["cc_*"]))


# -- chunking, validation hold-out, document IDs -----------------------------------------------


def _row_group_of(m, chunk):
    for first, rows in m.shards[chunk.shard].row_groups:
        if first <= chunk.start < first + rows:
            return first, rows
    raise AssertionError(chunk)


@pytest.mark.parametrize("min_chunks", [16, 64])
def test_small_source_is_cut_into_enough_chunks_inside_row_groups(make_cfg, min_chunks):
    """Guards: a 2-shard source feeding only 2 of 64 consumers (and so few buffers), and chunks that
    straddle row groups (two reads per chunk, and a cursor that cannot address them). Curated has
    2 shards; books has 2 shards of 21 rows: it can have at most one chunk per row."""
    m = build_manifest(make_cfg(min_chunks_per_source=min_chunks))
    for name in ("curated", "books"):
        info = m.sources[name]
        assert len(info.shards) == 2
        rows = sum(n for s in info.shards for _, n in m.shards[s].row_groups)
        assert len(info.chunks) >= min(min_chunks, rows)
        covered: Counter = Counter()
        for c in info.chunks:
            first, n = _row_group_of(m, c)
            assert first <= c.start < c.stop <= first + n  # inside one row group
            covered.update((c.shard, r) for r in range(c.start, c.stop))
        assert max(covered.values()) == 1 and len(covered) == rows == info.docs  # every row once


def test_min_chunks_reached_with_uneven_row_groups(tmp_path):
    """Guards: equal parts per row group capped by tiny row groups (2 rows), leaving the source with
    fewer chunks than asked although its big row group could be cut further."""
    write_shard(tmp_path / "c" / "tiny.parquet", texts("web_a", 2))
    write_shard(tmp_path / "c" / "big.parquet", texts("web_b", 200), row_group_size=200)
    m = build_manifest(one_source_cfg(tmp_path, str(tmp_path / "c" / "*.parquet"), min_chunks_per_source=64))
    assert len(m.sources["web"].chunks) >= 64
    assert sum(c.stop - c.start for c in m.sources["web"].chunks) == 202


def test_chunking_does_not_depend_on_ranks_or_workers(make_cfg):
    """Guards: chunk boundaries (and so the global order and every cursor) changing with the
    number of workers. build_manifest never sees ranks; the worker count must not leak in."""
    ms = [build_manifest(make_cfg(num_workers=w)) for w in (0, 1, 7)]
    assert len({m.fingerprint() for m in ms}) == 1
    for name in ms[0].sources:
        assert ms[0].sources[name].chunks == ms[1].sources[name].chunks == ms[2].sources[name].chunks


def test_val_chunks_disjoint_from_training_and_independent_of_seed(make_cfg):
    """Guards: validation documents leaking into training, and every seed (ablation arm) being
    validated on different documents. The held-out chunks are a fixed spread of the source."""
    whole = build_manifest(make_cfg())
    a = build_manifest(make_cfg(val_tokens_per_source=2000))
    b = build_manifest(make_cfg(val_tokens_per_source=2000, seed=99))
    for name, info in a.sources.items():
        assert info.val_chunks and info.val_chunks == b.sources[name].val_chunks
        val_rows = {(c.shard, r) for c in info.val_chunks for r in range(c.start, c.stop)}
        train_rows = {(c.shard, r) for c in info.chunks for r in range(c.start, c.stop)}
        assert not val_rows & train_rows
        assert sorted(info.chunks + info.val_chunks, key=lambda c: (c.shard, c.start)) == whole.sources[name].chunks
        assert info.docs == whole.sources[name].docs - len(val_rows)
        assert info.tokens < whole.sources[name].tokens


def test_same_stem_in_different_folders_gets_distinct_readable_ids(tmp_path):
    """Guards: doc IDs colliding for `part-0.parquet` in several folders (the usual layout of
    downloaded corpora), which would make the order dump ambiguous. Colliding stems are qualified
    by their folder; a unique stem stays bare."""
    write_shard(tmp_path / "c" / "en" / "part-0.parquet", texts("web_a", 3))
    write_shard(tmp_path / "c" / "de" / "part-0.parquet", texts("web_b", 3))
    write_shard(tmp_path / "c" / "de" / "solo.parquet", texts("web_c", 3))
    m = build_manifest(one_source_cfg(tmp_path, str(tmp_path / "c" / "*" / "*.parquet")))
    stems = sorted(s.stem for s in m.shards)
    assert stems == ["de/part-0", "en/part-0", "solo"]
    ids = {m.doc_id(i, 0) for i in range(len(m.shards))}
    assert ids == {"de/part-0:0", "en/part-0:0", "solo:0"}


# -- token_count and text sanity at start-up (issue 17) ----------------------------------------------------


def _rewrite(path: Path, **columns) -> Path:
    """The same parquet file (row groups kept) with some columns replaced by ``f(old column)``."""
    pf = pq.ParquetFile(path)
    groups = [pf.read_row_group(i) for i in range(pf.num_row_groups)]
    with pq.ParquetWriter(path.with_suffix(".new"), pf.schema_arrow) as w:
        for t in groups:
            for name, f in columns.items():
                t = t.set_column(t.schema.get_field_index(name), name, f(t.column(name)))
            w.write_table(t)
    os.replace(path.with_suffix(".new"), path)
    return path


def _scaled(factor: float):
    return lambda col: pa.array([int(v * factor) for v in col.to_pylist()], pa.int64())


def test_negative_token_count_is_a_bad_file(tmp_path, good_dir):
    """Before: accepted, giving a wrong plan (and "inf" epochs when a source summed to <= 0)."""
    path = sorted(good_dir.glob("*.parquet"))[0]
    _rewrite(path, token_count=lambda col: pa.array([-5] + col.to_pylist()[1:], pa.int64()))
    with pytest.raises(ConfigError) as err:
        build_manifest(one_source_cfg(tmp_path, str(good_dir / "*.parquet")))
    assert f"{path}: row group 0: token_count has 1 negative value(s) (min -5); it must be each document's " \
           "token count (data.tokenizer)" in str(err.value)


@pytest.mark.parametrize("factor", [100, 1 / 1000])
def test_token_count_off_by_a_factor_names_the_file(tmp_path, good_dir, factor, scan_calls):
    """Before: a x100 or /1000 column planned silently wrong epochs and hold-outs. A seeded sample of 16
    rows per source is tokenized; outside x0.95..x1.05 the file is named. The outcome is cached with the
    scan, so a cached start-up refuses it too, without reading text."""
    bad, good = sorted(good_dir.glob("*.parquet"))
    _rewrite(bad, token_count=_scaled(factor))
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    for attempt in range(2):
        with pytest.raises(ConfigError) as err:
            build_manifest(cfg)
        msg = str(err.value)
        assert msg.startswith(f"data.sources.web: token_count does not match the text ({bad}: token_count "), msg
        assert str(good) not in msg and "the sample of 16 row(s) must be within x0.95..x1.05 of its count with " \
                                        "data.tokenizer (cl100k_base): a column counted with another" in msg
        assert f"(x{factor:.3g})" in msg or factor < 1
    assert sorted(scan_calls) == sorted(str(p) for p in (bad, good))  # scanned once: the second start was cached


def test_token_count_sample_is_deterministic_and_accepts_true_counts(tmp_path, good_dir, monkeypatch):
    from data import tokenizer

    seen = []
    real = tokenizer.Tokenizer.count
    monkeypatch.setattr(tokenizer.Tokenizer, "count",
                        lambda self, texts, *a: seen.append(list(texts)) or real(self, texts, *a))
    for i in range(2):
        build_manifest(one_source_cfg(tmp_path / str(i), str(good_dir / "*.parquet")))  # fresh caches
    n = sum(len(t) for t in seen) // 2
    assert n == manifest_mod.SAMPLE_ROWS and seen[: len(seen) // 2] == seen[len(seen) // 2:]


def test_a_source_of_empty_documents_is_refused(tmp_path, good_dir):
    """Before: trained on EOT tokens only, with no warning."""
    for path in good_dir.glob("*.parquet"):
        _rewrite(path, text=lambda col: pa.array([""] * len(col), pa.string()),
                 token_count=lambda col: pa.array([0] * len(col), pa.int64()))
    with pytest.raises(ConfigError, match=r"^data.sources.web: all [\d,]+ document\(s\) are empty \(token_count 0 "
                                          r"and empty `text` in the sample\); it would train on EOT tokens only"):
        build_manifest(one_source_cfg(tmp_path, str(good_dir / "*.parquet")))


def test_null_texts_are_counted_from_the_footers_and_cached(tmp_path, good_dir, caplog, scan_calls):
    """Before: one null text killed the run when its chunk was first read, hours in. The footers' null
    counts are read at start-up (no text) into manifest.null_texts, named in a warning (``train fit``
    refuses them unless on_bad_shard: skip), and kept in the cache."""
    path = sorted(good_dir.glob("*.parquet"))[1]
    _rewrite(path, text=lambda col: pa.array([None if i in (3, 5) else t for i, t in enumerate(col.to_pylist())],
                                             pa.string()))
    cfg = one_source_cfg(tmp_path, str(good_dir / "*.parquet"))
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="data.manifest"):
            m = build_manifest(cfg)
        assert m.null_texts == {str(path): [[g, 2] for g in range(4)]}  # rows 3 and 5 of each row group
        assert (f"{path}: column 'text' has 8 null value(s) (row group 0: 2, row group 1: 2, row group 2: 2, "
                "row group 3: 2); fix the file, or set "
                "data.on_bad_shard: skip to leave those rows out") in caplog.text
        caplog.clear()
    assert len(scan_calls) == 2  # the second build came from the cache, null counts included
    with caplog.at_level(logging.WARNING, logger="data.manifest"):
        build_manifest(one_source_cfg(tmp_path, str(good_dir / "*.parquet"), on_bad_shard="skip"))
    assert f"{path}: column 'text' has 8 null value(s) (row group 0: 2, row group 1: 2, row group 2: 2, row group 3: " \
           "2); those rows are left out (data.on_bad_shard: skip)" in caplog.text
