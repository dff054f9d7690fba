"""The embedded demo corpus: Dolma3 schema, mixture proportions, shard layout, exact token counts,
determinism and reuse. The corpus is built once per module (a few seconds)."""

import json
import random
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.corpus.demo import MANIFEST, MAX_DOC_CHARS, SOURCES, build_demo_corpus
from data.tokenizer import cl100k_encoding

REPO = Path(__file__).resolve().parents[2]
# Token shares (min, max) per mixture source.
SHARE_RANGES = {"web": (0.55, 0.65), "code": (0.15, 0.25), "books": (0.10, 0.15), "curated": (0.05, 0.10)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_corpus")
    return out, build_demo_corpus(out)


@pytest.fixture(scope="module")
def tables(built) -> dict[Path, pa.Table]:
    out, _ = built
    return {path: pq.read_table(path) for path in sorted(out.glob("*/*.parquet"))}


def test_schema_is_exactly_dolma3(tables):
    expected = [
        ("source", pa.string()),
        ("date", pa.string()),
        ("text", pa.string()),
        ("token_count", pa.int64()),
        ("category", pa.string()),
    ]
    for path, table in tables.items():
        assert [(f.name, f.type) for f in pq.read_schema(path)] == expected, path
        assert all(column.null_count == 0 for column in table.columns), path


def test_layout_matches_manifest(built, tables):
    out, summary = built
    assert summary["reused"] is False
    assert {p.name for p in out.iterdir() if p.is_dir()} == {p.parent.name for p in tables} == set(SOURCES)
    assert json.loads((out / MANIFEST).read_text()) == {k: v for k, v in summary.items() if k != "reused"}
    listed = {(category, s["name"]) for category, src in summary["sources"].items() for s in src["shards"]}
    assert {(p.parent.name, p.stem) for p in tables} == listed
    assert not [p for p in out.rglob(".*")], "temp files left behind"
    for path, table in tables.items():
        shard = next(s for s in summary["sources"][path.parent.name]["shards"] if s["name"] == path.stem)
        assert shard["rows"] == table.num_rows
        assert shard["tokens"] == sum(table["token_count"].to_pylist())


def test_shards_are_clustered_with_several_row_groups(tables):
    stems = [p.stem for p in tables]
    assert len(stems) == len(set(stems)), "shard stems must be unique: document IDs are <stem>:<row>"
    for path, table in tables.items():
        assert pq.ParquetFile(path).metadata.num_row_groups >= 2, path
        assert table["category"].unique().to_pylist() == [path.parent.name]
        # One sub-source per shard, named after its mixture source, like a Dolma3 file.
        (sub_source,) = table["source"].unique().to_pylist()
        assert sub_source.startswith(path.parent.name + "_") and path.stem.startswith(sub_source + "-")


def test_mixture_proportions(built):
    _, summary = built
    sources = summary["sources"]
    total = sum(s["tokens"] for s in sources.values())
    for category, (lo, hi) in SHARE_RANGES.items():
        assert lo <= sources[category]["tokens"] / total <= hi, (category, sources[category]["tokens"] / total)
        assert len(sources[category]["shards"]) >= 2, category
    assert min(sources, key=lambda c: sources[c]["tokens"]) == "curated"
    assert len(sources["curated"]["shards"]) < 8


def test_token_counts_are_true_cl100k_counts(tables):
    rows = [row for table in tables.values() for row in table.select(["text", "token_count"]).to_pylist()]
    enc = cl100k_encoding()
    for row in random.Random(0).sample(rows, 80):
        assert len(enc.encode_ordinary(row["text"])) == row["token_count"]


def test_documents_are_nonempty_capped_and_varied(tables):
    counts = []
    for table in tables.values():
        for row in table.to_pylist():
            assert row["text"].strip() and len(row["text"]) <= MAX_DOC_CHARS
            date.fromisoformat(row["date"])
            counts.append(row["token_count"])
    # A realistic spread: many short documents, some of several thousand tokens.
    assert statistics.median(counts) < 500 and sum(c > 3000 for c in counts) >= 20


def test_build_is_deterministic_and_replaces_stale_shards(built, tables, tmp_path):
    stale = tmp_path / "web" / "web_stale-0000.parquet"
    stale.parent.mkdir()
    stale.write_bytes(b"left over from an older build")
    again = build_demo_corpus(tmp_path, force=True)
    assert not stale.exists()
    assert again["content_hash"] == built[1]["content_hash"]
    for path, table in tables.items():
        other = pq.read_table(tmp_path / path.parent.name / path.name)
        assert other["text"].equals(table["text"]) and other["date"].equals(table["date"])


def test_complete_corpus_is_reused(built):
    out, summary = built
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = build_demo_corpus(out)
    assert again["reused"] is True and again["content_hash"] == summary["content_hash"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_cli_prints_table(built):
    out, _ = built
    result = subprocess.run(
        [sys.executable, "scripts/make_demo_corpus.py", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "already holds this corpus" in result.stdout
    for category in SOURCES:
        assert f"\n{category} " in result.stdout
