"""The real corpus, loudly: the Dolma 3 mapping at start-up, bad rows named, corpus changes caught.

Corpora here mimic the real names (data/corpus/dolma3_like.py: ``common_crawl_<topic>`` and
``common_crawl-<topic>-0001``, ``s2pdf_<topic>`` and ``olmocr_science_pdfs``, ``stack-edu_Python`` and
``stack_edu-Python``, ``finemath-3plus``, the folder-derived ``rpj-proofpile-arxiv`` and
``dolma1_7-wiki-en``), read through configs/pretrain_350m_20b.yaml's own ``sources:`` block.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scripts_in_process import load_script

from data.config import DataConfig, FilterConfig, SourceConfig, load_data_config
from data.corpus.dolma3_like import SUBSOURCES, write_dolma3_like
from data.errors import ConfigError
from data.manifest import build_manifest
from data.mapping import REPORT_FILE, write_mapping_report
from data.schedules import fixed_schedule
from data.tokenizer import TokenizerConfig

count_tokens = TokenizerConfig().build().count

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "configs" / "pretrain_350m_20b.yaml"


@pytest.fixture(scope="module")
def dolma3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dolma3_like")
    write_dolma3_like(out / "plain")
    write_dolma3_like(out / "extra_big", extra={"megamath_web": 0.005})  # 0.49% of the tokens
    return out


def real_cfg(folder: Path, tmp_path: Path, monkeypatch, **overrides) -> DataConfig:
    """configs/pretrain_350m_20b.yaml's data section over ``folder`` ($DOLMA3_DIR), its own cache."""
    monkeypatch.setenv("DOLMA3_DIR", str(folder))
    return load_data_config(REAL, {"manifest_cache": str(tmp_path / "cache"), "val_tokens_per_source": 0,
                                   "min_chunks_per_source": 4, **overrides})


def with_filter(cfg: DataConfig, name: str, **changes) -> DataConfig:
    filt = cfg.sources[name].filter
    cfg.sources[name] = SourceConfig(paths=cfg.sources[name].paths, filter=FilterConfig(
        column=filt.column, values=changes.get("values", filt.values), optional=changes.get("optional", filt.optional)))
    return cfg


# -- the mapping report --------------------------------------------------------------------------


def test_the_real_patterns_claim_every_dolma3_name_in_both_spellings(dolma3, tmp_path, monkeypatch):
    m = build_manifest(real_cfg(dolma3 / "plain", tmp_path, monkeypatch))
    matched = {sm.name: {v for pm in sm.patterns for v in pm.values} for sm in m.mapping.sources}
    assert matched == {
        "web": {"common_crawl_science_math_and_technology", "common_crawl_health", "common_crawl-literature-0001"},
        "code": {"stack-edu_Python", "stack_edu-Python"},
        "pdfs": {"s2pdf_science_tech", "olmocr_science_pdfs"},
        "curated": {"finemath-3plus", "rpj-proofpile-arxiv", "dolma1_7-wiki-en"},
    }
    assert set().union(*matched.values()) == set(SUBSOURCES) and not m.mapping.unclaimed and not m.mapping.errors
    shares = {sm.name: sm.tokens / m.mapping.totals["source"][1] for sm in m.mapping.sources}
    assert shares["web"] == pytest.approx(0.761, abs=0.01) and shares["pdfs"] == pytest.approx(0.136, abs=0.01)
    assert {n: s.tokens for n, s in m.sources.items()} == {sm.name: sm.tokens for sm in m.mapping.sources}
    text = m.mapping.text()
    assert "  'arxiv*' (optional): MATCHES NOTHING" in text and "unclaimed `source` values: none" in text
    path = write_mapping_report(m.mapping, tmp_path / "run")
    assert path == tmp_path / "run" / REPORT_FILE and path.read_text() == text + "\n"


@pytest.mark.parametrize("limit", [0.001, 0.01])
def test_an_unclaimed_sub_source_is_an_error_above_data_unclaimed_and_a_warning_below(
        dolma3, tmp_path, monkeypatch, caplog, limit):
    cfg = real_cfg(dolma3 / "extra_big", tmp_path, monkeypatch, unclaimed=limit)
    if limit < 0.0049:
        with pytest.raises(ConfigError, match=r"^data.unclaimed: `source` value\(s\) 'megamath_web' \(1 in all, "
                                              r"0\.49\d% of the tokens\) are claimed by no mixture source") as e:
            build_manifest(cfg)
        assert "\n  unclaimed `source` values (never read):\n      megamath_web " in str(e.value)  # the report
        return
    with caplog.at_level(logging.WARNING):
        m = build_manifest(cfg)
    assert "'megamath_web'" in caplog.text and "below data.unclaimed 1.000%" in caplog.text
    assert list(m.mapping.unclaimed["source"]) == ["megamath_web"]


def test_a_pattern_matching_nothing_is_an_error_naming_it_unless_optional(dolma3, tmp_path, monkeypatch):
    cfg = with_filter(real_cfg(dolma3 / "plain", tmp_path, monkeypatch), "web", values=["common_crawl*", "cc*"])
    with pytest.raises(ConfigError, match=r"^data.sources.web.filter.values: pattern 'cc\*' matches no `source` "
                                          r"value in the source's 3 file\(s\).*filter.optional"):
        build_manifest(cfg)
    cfg = with_filter(real_cfg(dolma3 / "plain", tmp_path, monkeypatch), "web", values=["common_crawl*"],
                      optional=["cc*"])
    assert "'cc*' (optional): MATCHES NOTHING" in build_manifest(cfg).mapping.text()


def test_a_value_two_sources_claim_is_refused(dolma3, tmp_path, monkeypatch):
    cfg = with_filter(real_cfg(dolma3 / "plain", tmp_path, monkeypatch), "curated", values=["finemath*", "stack*"])
    with pytest.raises(ConfigError, match=r"value 'stack-edu_Python' is claimed by code, curated .*trained twice"):
        build_manifest(cfg)


# -- corpus integrity between save and resume -------------------------------------------------------


def _rewrite(path: Path, rows: list[dict], keep_mtime: bool = True) -> None:
    st = os.stat(path)
    table = pa.Table.from_pylist(rows, schema=pq.read_schema(path))
    pq.write_table(table, path, row_group_size=pq.ParquetFile(path).metadata.row_group(0).num_rows)
    if keep_mtime:  # a copy tool that keeps times: the manifest cache key alone would not see it
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _edit_one_text(rows: list[dict]) -> list[dict]:
    rows = [dict(r) for r in rows]
    rows[3]["text"] = rows[3]["text"].replace("e", "a", 1) + " edited"
    rows[3]["token_count"] = count_tokens([rows[3]["text"]])[0]
    return rows


@pytest.mark.parametrize("change", ["text edited in place", "rows reordered in place"])
def test_a_changed_file_changes_the_fingerprint_and_the_resume_names_it(demo_corpus, tmp_path, make_cfg, change):
    from train.datamodule import WellMixedData

    corpus = tmp_path / "corpus"
    shutil.copytree(demo_corpus, corpus)
    cfg = make_cfg(sources={s: SourceConfig(paths=[str(corpus / s / "*.parquet")]) for s in
                            ("web", "code", "books", "curated")}, manifest_cache=str(tmp_path / "cache"))
    dm = WellMixedData(cfg)
    manifest = dm.prepare().manifest
    state = {"cursors": [[None] * cfg.num_workers], "next_step": 4, "world_size": 1, "num_workers": cfg.num_workers,
             "batch_size": cfg.batch_size, "accumulate": 1, "seed": cfg.seed, "fingerprint": manifest.fingerprint(),
             "corpus_files": manifest.file_digests()}
    victim = sorted((corpus / "curated").glob("*.parquet"))[0]
    rows = pq.read_table(victim).to_pylist()
    _rewrite(victim, _edit_one_text(rows) if change.startswith("text") else rows[::-1])
    again = WellMixedData(cfg)
    changed = again.prepare().manifest
    assert changed.fingerprint() != state["fingerprint"]
    assert changed.changed_files(state["corpus_files"]) == [f"{victim} (bytes changed)"]
    with pytest.raises(ConfigError, match=rf"the corpus changed .*1 file\(s\): {victim} \(bytes changed\).*"
                                          r"--run.allow_changed_data true"):
        again.load_state_dict(state)
    again.allow_changed_data = True  # the way out: a fresh order, no cursor of the old rows is loaded
    again.load_state_dict(state)
    assert again._resume.state is None and again._resumed_cursors() is None


# -- bad rows named at start-up -------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path, demo_corpus) -> list[Path]:
    out = tmp_path / "shards"
    out.mkdir()
    for src in sorted((demo_corpus / "curated").glob("*.parquet")):
        shutil.copy(src, out / src.name)
    return sorted(out.glob("*.parquet"))


def one_source(shards: list[Path], tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(sources={"web": SourceConfig(paths=[str(shards[0].parent / "*.parquet")])},
                      schedule=fixed_schedule({"web": 1.0}, 2048), manifest_cache=str(tmp_path / "cache"), **kw)


def _set_column(path: Path, name: str, values: list) -> None:
    table = pq.read_table(path)
    i = table.schema.get_field_index(name)
    pq.write_table(table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type)), path,
                   row_group_size=pq.ParquetFile(path).metadata.row_group(0).num_rows)


def test_all_empty_texts_with_token_count_one_are_refused(shards, tmp_path):
    for p in shards:
        n = pq.read_metadata(p).num_rows
        _set_column(p, "text", [""] * n)
        _set_column(p, "token_count", [1] * n)
    with pytest.raises(ConfigError, match=r"^data.sources.web: all 16 sampled document\(s\) have an empty `text` .*"
                                          r"token_count sums to 16 over them\); the source would train on EOT tokens"):
        build_manifest(one_source(shards, tmp_path))


def test_a_missing_text_column_names_the_key(shards, tmp_path):
    with pytest.raises(ConfigError, match=r"^data.text_column: column 'content' is missing from 2 of 2 input file\(s\) "
                                          r"\(their columns: source, date, text, token_count, category\)"):
        build_manifest(one_source(shards, tmp_path, text_column="content"))


def test_invalid_utf8_in_the_token_count_sample_names_the_file_and_row(shards, tmp_path):
    table = pq.read_table(shards[0])
    texts = [t.encode() for t in table.column("text").to_pylist()]
    texts = [b"caf\xe9 " + t for t in texts]  # Latin-1, not UTF-8, in every row (whichever the sample picks)
    i = table.schema.get_field_index("text")
    pq.write_table(table.set_column(i, pa.field("text", pa.string()), pa.array(texts, pa.binary()).view(pa.string())),
                   shards[0], row_group_size=pq.ParquetFile(shards[0]).metadata.row_group(0).num_rows)
    with pytest.raises(ConfigError, match=rf"^{shards[0]}: row \d+: column 'text' is not valid UTF-8 "
                                          r"\(invalid continuation byte at byte 3\)"):
        build_manifest(one_source(shards, tmp_path))


def test_token_count_zero_with_held_out_tokens_blames_the_column(shards, tmp_path):
    for p in shards:
        _set_column(p, "token_count", [0] * pq.read_metadata(p).num_rows)
    with pytest.raises(ConfigError, match=r"^data.sources.web: the token_count column sums to 0 over its [\d,]+ "
                                          r"document\(s\), so no tokens can be held out"):
        build_manifest(one_source(shards, tmp_path, val_tokens_per_source=1000))


# -- corpus tools: an incomplete shuffle output is not a corpus ------------------------------------


def test_a_shuffle_killed_after_3_of_12_buckets_is_refused_by_every_reader(dolma3, tmp_path, monkeypatch, capsys):
    from data.corpus.shuffle import ShuffleSpec, gather, list_inputs, scatter, shuffle
    dump_order, inspect_corpus = load_script("dump_order"), load_script("inspect_corpus")

    out = tmp_path / "shuffled"
    spec = ShuffleSpec(list_inputs([str(dolma3 / "plain" / "*.parquet")]), str(out), buckets=12, seed=1)
    scatter(spec)
    gather(spec, buckets=[0, 1, 2])  # then killed
    want = rf"{out}: an incomplete global-shuffle output \(3 bucket\(s\), no shuffle_report.json\); rerun"
    with pytest.raises(ConfigError, match=want):
        build_manifest(real_cfg(out, tmp_path, monkeypatch))
    assert inspect_corpus.main([str(out)]) == 2
    assert dump_order.main(["--config", str(REAL), "--out", str(tmp_path / "o.jsonl"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("an incomplete global-shuffle output (3 bucket(s)") == 2 and err.startswith("error: ")
    report = shuffle(spec)  # the same command again finishes it: now a corpus
    assert report["ok"] and len(report["bucket_files"]) == 12
    assert build_manifest(real_cfg(out, tmp_path, monkeypatch)).mapping.errors == []
    (out / "bucket-00004.parquet").unlink()  # a bucket lost since the record was written
    with pytest.raises(ConfigError, match=r"the buckets do not match shuffle_report.json \(12 recorded, 11 present: "
                                          r"missing \['bucket-00004.parquet'\]\)"):
        build_manifest(real_cfg(out, tmp_path, monkeypatch))


def test_a_shuffle_out_inside_an_input_folder_is_refused(dolma3, tmp_path):
    global_shuffle = load_script("global_shuffle")

    inputs = tmp_path / "in"
    shutil.copytree(dolma3 / "plain", inputs)
    assert global_shuffle.main([str(inputs / "*.parquet"), "--out", str(inputs / "shuffled"), "--buckets", "2"]) == 2
    assert not (inputs / "shuffled").exists() and sorted(p.name for p in inputs.iterdir())[0] == "part-00000.parquet"
    with pytest.raises(ConfigError, match=rf"--out {inputs} is inside the input folder {inputs}"):
        from data.corpus.shuffle import ShuffleSpec

        ShuffleSpec([str(p) for p in sorted(inputs.glob("*.parquet"))], str(inputs))


# -- scripts/inspect_corpus.py: the value table, a sources block to paste, duplicates -------------------


def test_inspect_proposes_a_sources_block_that_claims_every_dolma3_value(dolma3, tmp_path, monkeypatch):
    import yaml

    from data.corpus.inspect import duplicate_counts, inspect_corpus, propose_sources

    summary = inspect_corpus(dolma3 / "extra_big")
    block = propose_sources(summary)
    assert "#   megamath_web " in block  # no Dolma 3 family: listed, left for the user to place
    pasted = tmp_path / "pasted.yaml"
    real = yaml.safe_load(REAL.read_text())
    real["data"]["sources"] = yaml.safe_load(block)["sources"]
    pasted.write_text(yaml.safe_dump(real))
    monkeypatch.setenv("DOLMA3_DIR", str(dolma3 / "plain"))
    cfg = load_data_config(pasted, {"manifest_cache": str(tmp_path / "cache"), "val_tokens_per_source": 0})
    m = build_manifest(cfg)
    assert set().union(*({v for pm in sm.patterns for v in pm.values} for sm in m.mapping.sources)) == set(SUBSOURCES)
    assert cfg.sources["code"].filter.values == ["stack-edu*", "stack_edu*"]  # both spellings, as in the files
    dups = duplicate_counts(summary.paths, sample_rows=10_000)
    assert dups["finemath-3plus"] == [8, 4] and sum(d for _, d in dups.values()) == 4  # each written twice
