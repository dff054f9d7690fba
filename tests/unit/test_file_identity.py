"""One file is one file: a file's identity is the file (device and inode), never its spelling.

A source's globs that meet on a file (overlapping globs, a relative and an absolute path, a folder
reached through a symbolic link) read it once, under one document-ID stem; a file claimed by two
sources without filters is refused before compute, naming both globs; two filtered sources reading
one file under two spellings see one file (no false "unclaimed" share).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig, FilterConfig, SourceConfig
from data.corpus.shuffle import list_inputs
from data.errors import ConfigError
from data.manifest import build_manifest
from data.schedules import fixed_schedule
from data.simulate import OrderSimulator
from data.tokenizer import TokenizerConfig

count_tokens = TokenizerConfig().build().count

SOURCES = ["web", "code", "books", "curated"]


def _pieces(cfg: DataConfig, steps: int = 40) -> list[list]:
    m = build_manifest(cfg)
    return [line["pieces"] for line in OrderSimulator(m, cfg, 1, 1).order_lines(steps)]


def test_a_source_whose_globs_meet_on_a_file_trains_it_once(make_cfg, demo_corpus, tmp_path, monkeypatch):
    """Guards: a file matched by two globs of one source (or two spellings of it) trained twice under two IDs,
    or a start-up crash (``PosixPath('.') has an empty name``) when the spellings share a stem."""
    base = make_cfg()
    (tmp_path / "lnk").symlink_to(demo_corpus)
    monkeypatch.chdir(demo_corpus.parent)
    code = demo_corpus / "code"
    spellings = [f"{demo_corpus.name}/code/*.parquet",  # relative
                 str(code / "*.parquet"),  # absolute
                 str(code / "*modules*.parquet"),  # an overlapping glob
                 str(tmp_path / "lnk" / "code" / "*.parquet")]  # through a symlinked folder
    cfg = make_cfg(sources={**base.sources, "code": SourceConfig(paths=spellings)})
    m, m0 = build_manifest(cfg), build_manifest(base)
    counts = [{n: (s.docs, s.tokens) for n, s in x.sources.items()} for x in (m, m0)]
    assert counts[0] == counts[1]
    assert sorted(s.stem for s in m.shards) == sorted(s.stem for s in m0.shards)
    assert m.fingerprint() == m0.fingerprint()
    assert _pieces(cfg) == _pieces(base)  # the same documents in the same order, under the same IDs


def test_a_file_two_sources_claim_is_refused_naming_both_globs(make_cfg, demo_corpus):
    """Guards: ``code: [.../code/*.parquet, .../*/*modules*.parquet]`` also taking web's files: 480K code
    tokens instead of 190K, and documents trained once as web and once as code."""
    base = make_cfg()
    wide = str(demo_corpus / "*" / "*modules*.parquet")
    code = SourceConfig(paths=[str(demo_corpus / "code" / "*.parquet"), wide])
    cfg = make_cfg(sources={**base.sources, "code": code})
    web = demo_corpus / "web"
    with pytest.raises(ConfigError) as e:
        build_manifest(cfg)
    assert str(e.value) == (
        f"data.sources.web.paths '{web}/*.parquet' and data.sources.code.paths '{wide}' both claim "
        f"{web}/web_modules-0000.parquet (and 2 more file(s)): its documents would be trained once per source; "
        "narrow the globs so that each file belongs to one source (or give every source reading it a filter)")


def _mixed_file(path: Path) -> Path:
    rows = [("alpha", f"alpha text {i} " * 5) for i in range(24)]
    rows += [("beta", f"beta words {i} " * 7) for i in range(24)]
    texts = [t for _, t in rows]
    pq.write_table(pa.table({"source": [s for s, _ in rows], "date": ["2024-01-01"] * len(rows), "text": texts,
                             "token_count": pa.array(count_tokens(texts), pa.int64()),
                             "category": ["x"] * len(rows)}), path, row_group_size=16)
    return path


def test_filtered_sources_reading_one_file_under_two_spellings_see_one_file(tmp_path):
    """Guards: a false "50% of the tokens unclaimed" when two filtered sources read one file under two
    spellings (each spelling's other values looked unclaimed)."""
    (tmp_path / "real").mkdir()
    _mixed_file(tmp_path / "real" / "mixed.parquet")
    (tmp_path / "lnk").symlink_to(tmp_path / "real")

    def source(folder: str, value: str) -> SourceConfig:
        return SourceConfig(paths=[str(tmp_path / folder / "*.parquet")], filter=FilterConfig("source", [value]))

    cfg = DataConfig(sources={"a": source("real", "alpha"), "b": source("lnk", "beta")}, unclaimed=0.0,
                     schedule=fixed_schedule({"a": 0.5, "b": 0.5}, 128),
                     manifest_cache=str(tmp_path / "cache"), val_tokens_per_source=0, min_chunks_per_source=1)
    m = build_manifest(cfg)
    assert not m.mapping.unclaimed and not m.mapping.errors and len(m.shards) == 1
    assert m.sources["a"].docs == m.sources["b"].docs == 24


def test_a_column_missing_from_a_file_several_sources_read_counts_it_once(tmp_path):
    """Guards: "column 'text' is missing from 4 of 2 input file(s)" when filtered sources share the files."""
    paths = []
    for i in range(2):
        p = _mixed_file(tmp_path / f"mixed-{i}.parquet")
        pq.write_table(pq.read_table(p).drop_columns(["text"]).slice(i), p)  # two files, not two copies of one
        paths.append(p)
    glob = str(tmp_path / "*.parquet")
    sources = {n: SourceConfig(paths=[glob], filter=FilterConfig("source", [n])) for n in ("alpha", "beta")}
    cfg = DataConfig(sources=sources,
                     schedule=fixed_schedule({"alpha": 0.5, "beta": 0.5}, 128),
                     manifest_cache=str(tmp_path / "cache"), val_tokens_per_source=0)
    with pytest.raises(ConfigError) as e:
        build_manifest(cfg)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("data.text_column: column 'text' is missing from 2 of 2 input file(s)")
    assert lines[1] == "2 bad input file(s):" and len(lines) == 5
    assert os.path.basename(lines[2].split(":")[0]) == "mixed-0.parquet"


def test_a_broken_link_a_glob_matches_is_named(make_cfg, demo_corpus, tmp_path):
    """Guards: a raw FileNotFoundError traceback at start-up for a dangling symlink among the shards."""
    folder = tmp_path / "code"
    folder.mkdir()
    for p in (demo_corpus / "code").glob("*.parquet"):
        (folder / p.name).symlink_to(p)
    (folder / "gone.parquet").symlink_to(tmp_path / "nowhere.parquet")
    base = make_cfg()
    cfg = make_cfg(sources={**base.sources, "code": SourceConfig(paths=[str(folder / "*.parquet")])})
    with pytest.raises(ConfigError) as e:
        build_manifest(cfg)
    assert str(e.value) == (f"{folder}/gone.parquet: matched by a glob but cannot be opened (No such file or "
                            "directory: a broken symbolic link?); restore it, remove it, or narrow the glob")


def test_the_global_shuffle_takes_a_file_its_globs_meet_on_once(demo_corpus, tmp_path):
    """Guards: a shard scattered twice (two spellings of one input), its rows duplicated in the buckets while
    the verification, which counted the input twice as well, passed."""
    (tmp_path / "lnk").symlink_to(demo_corpus)
    once = list_inputs([str(demo_corpus / "*" / "*.parquet")])
    assert list_inputs([str(demo_corpus / "*" / "*.parquet"), str(tmp_path / "lnk" / "code" / "*.parquet"),
                        str(demo_corpus / "code" / "*modules*.parquet")]) == once
    assert len(once) == 16


def test_a_byte_identical_copy_counts_once(make_cfg, demo_corpus, tmp_path, caplog):
    """Guards: a copy of a shard (another inode, another name and folder) adding its documents again under a
    second ID, and a start-up that read every file in full to find out (only footer-hash candidates are)."""
    base = make_cfg()
    copies = tmp_path / "copies"
    copies.mkdir()
    shard = sorted((demo_corpus / "code").glob("*.parquet"))[0]
    shutil.copyfile(shard, copies / "renamed.parquet")
    code = SourceConfig(paths=[str(demo_corpus / "code" / "*.parquet"), str(copies / "*.parquet")])
    cfg = make_cfg(sources={**base.sources, "code": code})
    m, m0 = build_manifest(cfg), build_manifest(base)
    counts = [{n: (s.docs, s.tokens) for n, s in x.sources.items()} for x in (m, m0)]
    assert counts[0] == counts[1]
    assert m.fingerprint() == m0.fingerprint()
    assert _pieces(cfg) == _pieces(base)
    assert f"{copies / 'renamed.parquet'} has the same bytes as {shard}" in caplog.text
    assert list_inputs([str(demo_corpus / "*" / "*.parquet"), str(copies / "*.parquet")]) == \
        list_inputs([str(demo_corpus / "*" / "*.parquet")])  # scattered once: the shuffle's rows are not doubled


def test_a_copy_under_another_source_is_refused_naming_both_paths(make_cfg, demo_corpus, tmp_path):
    """Guards: a copy of a web shard in code's folder making part of "code" web text, trained twice."""
    base = make_cfg()
    (tmp_path / "code").mkdir()
    for p in (demo_corpus / "code").glob("*.parquet"):
        os.link(p, tmp_path / "code" / p.name)
    web = sorted((demo_corpus / "web").glob("*.parquet"))[0]
    shutil.copyfile(web, tmp_path / "code" / "zz-copy.parquet")
    cfg = make_cfg(sources={**base.sources, "code": SourceConfig(paths=[str(tmp_path / "code" / "*.parquet")])})
    with pytest.raises(ConfigError) as e:
        build_manifest(cfg)
    assert str(e.value) == (
        f"data.sources.web.paths '{demo_corpus}/web/*.parquet' and data.sources.code.paths '{tmp_path}/code/*.parquet' "
        f"both claim {web} and its byte-identical copy {tmp_path}/code/zz-copy.parquet: its documents would be "
        "trained once per source; narrow the globs so that each file belongs to one source (or give every source "
        "reading it a filter)")


def test_only_candidate_copies_are_read_in_full(demo_corpus, tmp_path, monkeypatch):
    """Guards: a start-up that hashes the whole corpus to find copies (only equal size + footer hash is read)."""
    import hashlib

    from data.files import byte_copies
    shard = sorted((demo_corpus / "web").glob("*.parquet"))[0]
    twin = tmp_path / "twin.parquet"
    shutil.copyfile(shard, twin)
    read = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: read.append(f.name) or real(f, name))
    paths = sorted(str(p) for p in demo_corpus.glob("*/*.parquet")) + [str(twin)]
    assert byte_copies(paths) == {str(twin): str(shard)}
    assert sorted(read) == sorted([str(shard), str(twin)])


def test_a_glob_that_matches_nothing_beside_globs_that_match_is_refused(make_cfg, demo_corpus, monkeypatch):
    """Guards: a typo folder or an unset $VAR in a second glob dropped with no word (the source read less)."""
    monkeypatch.delenv("EXTRA_CODE", raising=False)
    base = make_cfg()
    good = str(demo_corpus / "code" / "*.parquet")
    code = SourceConfig(paths=[good, str(demo_corpus / "cdoe" / "*.parquet"), "$EXTRA_CODE/*.parquet"])
    with pytest.raises(ConfigError) as e:
        build_manifest(make_cfg(sources={**base.sources, "code": code}))
    assert str(e.value).splitlines() == [
        f"data.sources.code.paths '{demo_corpus}/cdoe/*.parquet': no file matches; every glob must match a file: "
        "fix the glob or remove it",
        "data.sources.code.paths '$EXTRA_CODE/*.parquet': environment variable $EXTRA_CODE is not set (export "
        "EXTRA_CODE=/path/to/the/corpus; docs/data-download.md); every glob must match a file: fix the glob or "
        "remove it"]
    with pytest.raises(ConfigError) as e:  # the global shuffle refuses it with the same line
        list_inputs([good, str(demo_corpus / "cdoe" / "*.parquet")])
    assert str(e.value) == (f"input glob '{demo_corpus}/cdoe/*.parquet': no file matches; every glob must match a "
                            "file: fix the glob or remove it")
