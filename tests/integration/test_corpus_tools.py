"""Global bucket shuffle and split by source (data/corpus/shuffle.py, scripts/global_shuffle.py,
scripts/split_by_source.py) on the real, clustered demo corpus: one sub-source per input file."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.corpus.shuffle import (
    RowStats,
    ShuffleSpec,
    gather,
    list_inputs,
    read_footer,
    scatter,
    shuffle,
    source_share_check,
    verify,
)
from data.corpus.split import split_by_source
from data.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BUCKETS = 8
MAPPING = {"web": ["web_*"], "code": ["code_*"], "books": ["books_*"], "curated": ["curated_*"]}


def make_spec(corpus: Path, out: Path, **kw) -> ShuffleSpec:
    return ShuffleSpec(
        list_inputs([str(corpus / "*" / "*.parquet")]), str(out), **{"buckets": BUCKETS, "seed": 42, **kw}
    )


def read_buckets(out: Path, buckets: int = BUCKETS) -> list[pa.Table]:
    return [pq.read_table(out / f"bucket-{b:05d}.parquet").replace_schema_metadata(None) for b in range(buckets)]


def all_rows(tables: list[pa.Table]) -> Counter:
    """Every row as a tuple of all its columns, with multiplicity."""
    return Counter(row for t in tables for row in zip(*(t.column(c).to_pylist() for c in t.column_names)))


@pytest.fixture(scope="module")
def baseline(demo_corpus, tmp_path_factory):
    """The demo corpus shuffled into 8 buckets (seed 42) in this process: (spec, report, tables)."""
    spec = make_spec(demo_corpus, tmp_path_factory.mktemp("shuffled") / "out", row_group_rows=64)
    report = shuffle(spec)
    return spec, report, read_buckets(Path(spec.out))


def test_rows_and_checksum_in_equal_out(baseline, demo_corpus):
    spec, report, tables = baseline
    assert report["ok"], report["problems"]
    inputs = [pq.read_table(p) for p in spec.inputs]
    assert report["rows_in"] == report["rows_out"] == sum(t.num_rows for t in inputs) == sum(t.num_rows for t in tables)
    assert report["checksum_in"] == report["checksum_out"]
    # The checksum's claim, checked directly: the outputs are the inputs as a multiset of whole rows.
    assert all_rows(tables) == all_rows(inputs)
    assert report["source_shares"]["within_sampling_error"]
    assert report["tokens_in"] == report["tokens_out"] == sum(sum(t.column("token_count").to_pylist()) for t in tables)
    assert json.loads((Path(spec.out) / "shuffle_report.json").read_text())["ok"]
    assert not spec.tmp_dir.exists(), "temp parts are deleted after a verified run"
    # Same schema, metadata included (the shuffle statistics are parquet key-value metadata).
    for b in range(BUCKETS):
        assert pq.read_schema(spec.output(b)).equals(pq.read_schema(spec.inputs[0]), check_metadata=True)
        assert read_footer(spec.output(b))["bucket"] == b


def test_every_bucket_mixes_sub_sources(baseline):
    """Each input file holds one sub-source; each bucket must hold many, in no clustered order."""
    spec, _, tables = baseline
    n_sub = len({s for t in tables for s in t.column("source").to_pylist()})
    assert n_sub == 10
    for t in tables:
        subs = t.column("source").to_pylist()
        assert len(set(subs)) >= 5, Counter(subs)
        # Clustered input: neighbours share a sub-source almost always. Shuffled: about sum(p_s^2) ~ 0.2.
        same = sum(a == b for a, b in zip(subs, subs[1:])) / (len(subs) - 1)
        assert same < 0.4, same


def test_same_seed_same_output_other_seed_differs(baseline, demo_corpus, tmp_path):
    spec, _, tables = baseline
    again = make_spec(demo_corpus, tmp_path / "again", row_group_rows=64)
    shuffle(again)
    assert all(a.equals(b) for a, b in zip(read_buckets(tmp_path / "again"), tables))
    other = make_spec(demo_corpus, tmp_path / "other", seed=43, row_group_rows=64)
    report = shuffle(other)
    assert report["ok"] and report["checksum_out"] == baseline[1]["checksum_out"]
    assert read_buckets(tmp_path / "other")[0].column("text").to_pylist() != tables[0].column("text").to_pylist()


def test_buffer_size_does_not_change_the_output(baseline, demo_corpus, tmp_path):
    """A tiny scatter buffer flushes after every row group: more part files, same buckets."""
    spec = make_spec(demo_corpus, tmp_path / "small_buffer", row_group_rows=64, buffer_mb=0.001)
    shuffle(spec)
    assert all(a.equals(b) for a, b in zip(read_buckets(tmp_path / "small_buffer"), baseline[2]))


def test_restart_rebuilds_only_the_missing_bucket(baseline, demo_corpus, tmp_path):
    out = tmp_path / "restart"
    spec = make_spec(demo_corpus, out, row_group_rows=64)
    shuffle(spec)
    mtimes = {b: spec.output(b).stat().st_mtime_ns for b in range(BUCKETS)}
    spec.output(3).unlink()
    report = shuffle(spec)
    assert report["ok"]
    assert report["run"]["buckets_written"] == [3]
    assert all(spec.output(b).stat().st_mtime_ns == mtimes[b] for b in range(BUCKETS) if b != 3)
    assert all(a.equals(b) for a, b in zip(read_buckets(out), baseline[2]))
    # Nothing missing: nothing is redone (input statistics come from the previous report).
    report = shuffle(spec)
    assert report["ok"] and report["run"]["scatter_tasks_run"] == 0 and report["run"]["buckets_written"] == []


def test_interrupted_temp_files_are_never_taken_for_output(baseline, demo_corpus, tmp_path):
    """Simulated crashes: a scatter task killed while writing (.partial left), one killed between its
    rename and its marker (parts without a marker), and a half-written bucket temp file."""
    out = tmp_path / "crash"
    spec = make_spec(demo_corpus, out, row_group_rows=64)
    scatter(spec)
    tmp = spec.tmp_dir
    (tmp / "f-00001.json").unlink()  # killed between rename and marker: its parts must be redone
    junk = pq.read_table(spec.inputs[0]).slice(0, 3)
    pq.write_table(junk, tmp / "f-00001" / "b-00000-p0099.parquet")
    (tmp / "f-00002.json").unlink()
    shutil.rmtree(tmp / "f-00002")
    (tmp / "f-00002.partial").mkdir()  # killed mid-write
    pq.write_table(junk, tmp / "f-00002.partial" / "b-00000-p0000.parquet")
    (out / ".bucket-00000.parquet.999.tmp").write_bytes(b"half a file")
    with pytest.raises(ConfigError, match="scatter tasks have not finished"):
        gather(spec)
    report = shuffle(spec)
    assert report["ok"] and report["run"]["scatter_tasks_run"] == 2
    assert all(a.equals(b) for a, b in zip(read_buckets(out), baseline[2]))


def test_array_task_split_matches_single_process(baseline, demo_corpus, tmp_path):
    out = tmp_path / "tasks"
    spec = make_spec(demo_corpus, out, row_group_rows=64)
    for i in range(3):
        scatter(spec, task_index=i, num_tasks=3)
    for i in reversed(range(3)):
        gather(spec, task_index=i, num_tasks=3)
    report = verify(spec)
    assert report["ok"], report["problems"]
    assert all(a.equals(b) for a, b in zip(read_buckets(out), baseline[2]))


def test_output_of_another_run_is_refused(baseline, demo_corpus):
    spec = make_spec(demo_corpus, Path(baseline[0].out), buckets=BUCKETS, seed=7)
    with pytest.raises(ConfigError, match="not written by this run"):
        shuffle(spec)


def test_verify_catches_a_lost_row(baseline, demo_corpus, tmp_path):
    out = tmp_path / "tampered"
    shutil.copytree(baseline[0].out, out)
    spec = make_spec(demo_corpus, out, row_group_rows=64)
    path = spec.output(2)
    table = pq.read_table(path)
    footer = read_footer(path)
    short = table.slice(1)  # a row lost, footer statistics recomputed to match the file
    stats = RowStats()
    stats.add_table(short, spec)
    footer["stats"] = stats.to_dict()
    pq.write_table(short.replace_schema_metadata({b"wellmixed.shuffle": json.dumps(footer).encode()}), path)
    report = verify(spec)
    assert not report["ok"]
    assert any("rows:" in p for p in report["problems"]) and any("checksum" in p for p in report["problems"])


def test_share_check_flags_a_clustered_bucket():
    """All of one source in bucket 0 is far outside Binomial(N_s, 1/B); a uniform split is not."""
    n = 800
    stats_in = RowStats(rows=2 * n, tokens=2 * n, sources={"a": [n, n], "b": [n, n]})
    even = [
        RowStats(rows=n // 4, tokens=n // 4, sources={"a": [n // 8, n // 8], "b": [n // 8, n // 8]}) for _ in range(8)
    ]
    assert source_share_check(stats_in, even)["within_sampling_error"]
    skewed = [RowStats(rows=n, tokens=n, sources={"a": [n, n]})] + [
        RowStats(rows=n // 7, tokens=n // 7, sources={"b": [n // 7, n // 7]}) for _ in range(7)
    ]
    check = source_share_check(stats_in, skewed)
    assert not check["within_sampling_error"] and check["worst"]["bucket"] == 0


def test_cli_with_worker_processes_matches(baseline, demo_corpus, tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, "scripts/global_shuffle.py", str(demo_corpus / "*" / "*.parquet"), "--out", str(out),
         "--buckets", str(BUCKETS), "--seed", "42", "--workers", "2", "--row-group-rows", "64", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"checksum +in (\w+) +out \1 +equal", r.stdout), r.stdout
    assert "within sampling error" in r.stdout and r.stdout.rstrip().splitlines()[-2] == "OK"
    assert all(a.equals(b) for a, b in zip(read_buckets(out), baseline[2]))


# ---------------------------------------------------------------------------------------------------
# Split by source


def test_split_round_trips_every_row_to_its_folder(baseline, tmp_path):
    spec, _, tables = baseline
    mapping = {k: v for k, v in MAPPING.items() if k != "books"}  # books left unmapped
    report = split_by_source(spec_outputs(spec), tmp_path / "split", mapping, column="source", row_group_rows=50)
    assert report["unmapped"] == {"books_reference": 21}
    assert not (tmp_path / "split" / "books").exists()

    report = split_by_source(spec_outputs(spec), tmp_path / "split", mapping, column="source", unmapped="other",
                             row_group_rows=50, rows_per_part=300, overwrite=True)
    assert report["rows_in"] == report["rows_out"] == sum(t.num_rows for t in tables)
    mixed = pa.concat_tables(tables)
    got = []
    for name in [*mapping, "other"]:
        parts = sorted((tmp_path / "split" / name).glob("part-*.parquet"))
        assert len(parts) == report["parts_per_source"][name] >= 1
        folder = pa.concat_tables([pq.read_table(p) for p in parts])
        assert pq.read_schema(parts[0]).equals(pq.read_schema(spec.inputs[0]).remove_metadata())
        pats = mapping.get(name, ["books_*"])
        assert all(any(fnmatch.fnmatchcase(s, p) for p in pats) for s in folder.column("source").to_pylist())
        # Row order within a source is the input's order.
        expected = [t for t, s in zip(mixed.column("text").to_pylist(), mixed.column("source").to_pylist())
                    if any(fnmatch.fnmatchcase(s, p) for p in pats)]
        assert folder.column("text").to_pylist() == expected
        got.append(folder)
    assert all_rows(got) == all_rows(tables)
    assert not list((tmp_path / "split").rglob("*.tmp"))


def spec_outputs(spec: ShuffleSpec) -> list[str]:
    return [str(spec.output(b)) for b in range(spec.buckets)]


@pytest.mark.slow
def test_bench_shuffle_quick_prints_its_figures(demo_corpus):
    r = subprocess.run(
        [sys.executable, "scripts/bench_shuffle.py", "--quick", "--synthetic-mb", "8", "--corpus", str(demo_corpus)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(re.findall(r"rows/s, +[\d.]+ MB/s parquet", r.stdout)) == 2, r.stdout
    assert re.search(r"gather peak RSS = \d+ MB \+ -?[\d.]+ x largest bucket", r.stdout), r.stdout


# -- checks that cannot fail must fail loudly (issue 17) ----------------------------------------------------


def test_split_with_no_matching_pattern_exits_2_and_writes_nothing(demo_corpus, tmp_path):
    """Before: exit 0 with every row LEFT OUT (a typo in --map, or the wrong --column, gave an empty split)."""
    inputs = str(demo_corpus / "curated" / "*.parquet")
    for extra in ([], ["--unmapped", "other"]):
        out = tmp_path / f"split{len(extra)}"
        r = subprocess.run(
            [sys.executable, "scripts/split_by_source.py", inputs, "--out", str(out), "--map", "web=web_*",
             "--map", "code=Curated*", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.strip() == ("error: --map: none of the 453 rows of 2 file(s) matched any pattern on column "
                                    "'source' (values there: curated_core 453); fix the patterns (fnmatch, "
                                    "case-sensitive) or --column"), r.stderr
        assert not list(out.rglob("*.parquet")) and not list(out.rglob("*.tmp"))
        assert not (out / "split_report.json").exists()


def test_share_check_with_no_testable_cell_fails_instead_of_passing(demo_corpus, tmp_path):
    """Before: 453 rows into 200 buckets tested 0 (bucket, source) cells and reported "within sampling
    error" (a check that cannot fail). Now it fails, says why, and exits 1; one bucket passes (nothing
    to test)."""
    n = 32  # 4 expected per bucket, below the 5 the normal approximation needs
    stats_in = RowStats(rows=n, tokens=n, sources={"a": [n, n]})
    few = [RowStats(rows=n // 8, tokens=n // 8, sources={"a": [n // 8, n // 8]}) for _ in range(8)]
    check = source_share_check(stats_in, few)
    assert check["cells_tested"] == 0 and not check["within_sampling_error"]
    assert check["untested"].startswith("source shares untested: no (bucket, source) cell expects >= 5 rows (8 too "
                                        "small: 8 buckets for 32 rows)")
    assert source_share_check(stats_in, [RowStats(rows=n, tokens=n, sources={"a": [n, n]})])["within_sampling_error"]

    r = subprocess.run(
        [sys.executable, "scripts/global_shuffle.py", str(demo_corpus / "curated" / "*.parquet"), "--out",
         str(tmp_path / "out"), "--buckets", "200", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert ("FAILED: source shares untested: no (bucket, source) cell expects >= 5 rows (200 too small: 200 buckets "
            "for 453 rows), so a clustered output would pass; use at most 90 --buckets") in r.stdout, r.stdout
