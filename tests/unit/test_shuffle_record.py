"""A global-shuffle output is checked row for row: its completion record pins every bucket (rows, size
and footer hash) and adds up to its own ``rows_out``; the manifest, ``dump_order.py`` and
``inspect_corpus.py`` refuse a folder that does not match it (data/shuffled.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scripts_in_process import load_script

from data.config import load_data_config
from data.corpus.dolma3_like import write_dolma3_like
from data.corpus.shuffle import FOOTER_KEY, ShuffleSpec, list_inputs, read_footer, shuffle
from data.errors import ConfigError
from data.manifest import build_manifest
from data.shuffled import record_checksum

REAL = Path(__file__).resolve().parents[2] / "configs" / "pretrain_350m_20b.yaml"
RECORD = "shuffle_report.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The dolma3-like corpus shuffled twice into 4 buckets (seeds 1 and 2): ``runs/seed1``, ``runs/seed2``."""
    root = tmp_path_factory.mktemp("shuffle_record")
    write_dolma3_like(root / "in")
    for seed in (1, 2):
        assert shuffle(ShuffleSpec(list_inputs([str(root / "in" / "*.parquet")]), str(root / f"seed{seed}"),
                                   buckets=4, seed=seed))["ok"]
    return root


@pytest.fixture
def out(runs, tmp_path) -> Path:
    """A copy of the seed-1 output to damage."""
    return Path(shutil.copytree(runs / "seed1", tmp_path / "shuffled"))


def _cfg(folder: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DOLMA3_DIR", str(folder))
    return load_data_config(REAL, {"manifest_cache": str(tmp_path / "cache"), "val_tokens_per_source": 0,
                                   "min_chunks_per_source": 4})


def _refused_by_every_reader(folder: Path, tmp_path: Path, monkeypatch, capsys) -> str:
    """The one error line the manifest, dump_order.py and inspect_corpus.py give for ``folder``."""
    with pytest.raises(ConfigError) as e:
        build_manifest(_cfg(folder, tmp_path, monkeypatch))
    line = str(e.value)
    assert "\n" not in line
    capsys.readouterr()
    assert load_script("inspect_corpus").main([str(folder)]) == 2
    assert load_script("dump_order").main(["--config", str(REAL), "--out", str(tmp_path / "o.jsonl"),
                                           "--steps", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"] * 2
    assert not (tmp_path / "o.jsonl").exists()
    return line


def test_a_bucket_copied_from_another_run_is_refused(runs, out, tmp_path, monkeypatch, capsys):
    """Guards: another run's bucket over one bucket accepted (its rows duplicated, this run's missing)."""
    shutil.copyfile(runs / "seed2" / "bucket-00001.parquet", out / "bucket-00001.parquet")
    line = _refused_by_every_reader(out, tmp_path, monkeypatch, capsys)
    assert line == (f"{out}: the buckets do not match {RECORD} (4 recorded, 4 present: changed since "
                    "['bucket-00001.parquet']); delete the changed and unrecorded bucket files, then rerun the same "
                    "scripts/global_shuffle.py command to finish it (it skips what is done)")


def test_a_bucket_deleted_and_the_record_edited_to_match_is_refused(out, tmp_path, monkeypatch, capsys):
    """Guards: a record whose own rows_out was never compared with the buckets it lists."""
    record = json.loads((out / RECORD).read_text())
    rows_lost = record["bucket_files"].pop("bucket-00002.parquet")[0]
    record["buckets"] = 3
    record["record_sha256"] = record_checksum(record)  # an editor who also fixed the record's own hash
    (out / RECORD).write_text(json.dumps(record))
    (out / "bucket-00002.parquet").unlink()
    line = _refused_by_every_reader(out, tmp_path, monkeypatch, capsys)
    assert line == (f"{out}/{RECORD}: does not add up (3 bucket(s) pinned with {record['rows_out'] - rows_lost:,} "
                    f"rows; the record says 3 bucket(s), rows_out {record['rows_out']}, rows_in {record['rows_in']}): "
                    "it was edited or damaged; rerun the same scripts/global_shuffle.py command to finish it (it "
                    "skips what is done)")


def test_a_record_that_cannot_pin_its_buckets_is_refused_with_the_command_that_rewrites_it(
        runs, out, tmp_path, monkeypatch, capsys):
    """Guards: a record written before per-bucket pins existed taken as proof (a copied bucket passed)."""
    record = json.loads((out / RECORD).read_text())
    pins = record.pop("bucket_files")
    del record["record_sha256"]  # neither had a record of that version
    (out / RECORD).write_text(json.dumps({**record, "bucket_bytes": {n: int(d.split(":")[0])
                                                                     for n, (_, d) in pins.items()}}))
    line = _refused_by_every_reader(out, tmp_path, monkeypatch, capsys)
    command = (f"python scripts/global_shuffle.py IN_GLOB --out {out} --buckets 4 --seed 1 --report-only")
    assert line == (f"{out}/{RECORD}: written by an older global_shuffle.py that does not pin each bucket's rows and "
                    "bytes, so it cannot show the buckets there are the ones it verified; re-verify them and rewrite "
                    f"it with: {command} (IN_GLOB: the run's input globs)")
    argv = command.split()[2:]
    argv[argv.index("IN_GLOB")] = str(runs / "in" / "*.parquet")
    global_shuffle = load_script("global_shuffle")
    shutil.copyfile(runs / "seed2" / "bucket-00003.parquet", out / "bucket-00003.parquet")
    assert global_shuffle.main(argv) == 2  # the command re-verifies: another run's bucket is not taken
    assert "bucket-00003.parquet exists but was not written by this run" in capsys.readouterr().err
    shutil.copyfile(runs / "seed1" / "bucket-00003.parquet", out / "bucket-00003.parquet")
    assert global_shuffle.main(argv) == 0
    m = build_manifest(_cfg(out, tmp_path, monkeypatch))
    m1 = build_manifest(_cfg(runs / "seed1", tmp_path, monkeypatch))
    assert json.loads((out / RECORD).read_text())["bucket_files"] == pins
    assert {n: s.tokens for n, s in m.sources.items()} == {n: s.tokens for n, s in m1.sources.items()}


def test_report_only_reads_the_rows_it_re_verifies(runs, out, tmp_path, monkeypatch, capsys):
    """Guards: ``--report-only`` re-blessing a bucket whose rows were replaced by duplicates of others with its
    footer (the statistics it verified from) carried over: the record said OK and the duplicates trained."""
    path = out / "bucket-00001.parquet"
    table = pq.read_table(path)
    footer = {FOOTER_KEY: pq.read_metadata(path).metadata[FOOTER_KEY]}
    damaged = pa.concat_tables([table.slice(0, table.num_rows - 12), table.slice(0, 12)])  # 12 rows duplicated
    pq.write_table(damaged.replace_schema_metadata(footer), path)  # the footer's statistics carried over
    assert read_footer(path) == read_footer(runs / "seed1" / "bucket-00001.parquet")
    argv = [str(runs / "in" / "*.parquet"), "--out", str(out), "--buckets", "4", "--seed", "1", "--report-only"]
    assert load_script("global_shuffle").main(argv) == 1
    assert f"{path}: its rows (" in capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    assert not record["ok"] and record["checksum_in"] != record["checksum_out"]
    with pytest.raises(ConfigError, match="the global shuffle's verification failed"):
        build_manifest(_cfg(out, tmp_path, monkeypatch))


def _rerun(runs: Path, out: Path) -> int:
    """The same global_shuffle.py command that wrote ``out`` (seed 1, 4 buckets), run again."""
    argv = [str(runs / "in" / "*.parquet"), "--out", str(out), "--buckets", "4", "--seed", "1", "--quiet"]
    return load_script("global_shuffle").main(argv)


def test_a_truncated_bucket_is_one_line_and_the_advice_repairs_it(runs, out, capsys):
    """Guards: an ArrowInvalid traceback when the same command is rerun over a truncated bucket."""
    path = out / "bucket-00002.parquet"
    path.write_bytes(path.read_bytes()[:1000])
    assert _rerun(runs, out) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: not a readable bucket (truncated or damaged: ")
    assert err[0].endswith("delete it and rerun the same scripts/global_shuffle.py command (only that bucket is "
                           "rebuilt)")
    path.unlink()
    assert _rerun(runs, out) == 0
    assert path.read_bytes() == (runs / "seed1" / path.name).read_bytes()


@pytest.mark.parametrize("content", ["null", "[]", '"done"'])
def test_a_record_that_is_not_a_record_is_named_and_a_rerun_rewrites_it(runs, out, tmp_path, monkeypatch, capsys,
                                                                        content):
    """Guards: an AttributeError traceback (``'list' object has no attribute 'get'``) from every reader and the
    tool when the record is valid JSON but not an object."""
    (out / RECORD).write_text(content)
    line = _refused_by_every_reader(out, tmp_path, monkeypatch, capsys)
    assert line == (f"{out}/{RECORD}: not a completion record (it holds {content}); rerun the same "
                    "scripts/global_shuffle.py command to finish it (it skips what is done)")
    assert _rerun(runs, out) == 0
    assert json.loads((out / RECORD).read_text())["ok"]


def test_an_edited_digest_in_the_record_names_the_record_not_the_buckets(runs, out, tmp_path, monkeypatch, capsys):
    """Guards: a digest edited in the record taken for six changed buckets (advice: delete them, all intact)."""
    record = json.loads((out / RECORD).read_text())
    for pin in record["bucket_files"].values():
        pin[1] = pin[1][:-1] + ("0" if pin[1][-1] != "0" else "1")
    (out / RECORD).write_text(json.dumps(record))
    line = _refused_by_every_reader(out, tmp_path, monkeypatch, capsys)
    assert line == (f"{out}/{RECORD}: edited or damaged (its record_sha256 does not match its content), so it shows "
                    "nothing about the buckets there, which need not be deleted: rerun the same "
                    "scripts/global_shuffle.py command to rewrite it (it re-reads the input and every bucket's rows)")
    before = {p.name: p.read_bytes() for p in out.glob("bucket-*.parquet")}
    assert _rerun(runs, out) == 0
    assert {p.name: p.read_bytes() for p in out.glob("bucket-*.parquet")} == before
    assert json.loads((out / RECORD).read_text())["bucket_files"] == \
        json.loads((runs / "seed1" / RECORD).read_text())["bucket_files"]
