"""scripts/inspect_corpus.py on a corpus in the Dolma3 layout (sub-source folders, suffixed values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

ROWS = {  # source value -> (category, rows, tokens per row)
    "common_crawl-food-0012": ("web", 5, 100),
    "stack_edu-python": ("code", 3, 50),
    "olmocr_science_pdfs-1": ("pdf", 2, 1000),
    "finemath-3plus": ("math", 4, 25),
    "wikipedia": ("encyclopedia", 1, 10),
    "reddit_dump": ("forum", 2, 7),  # no filter of the real config takes it
}


def make_dolma3_layout(root: Path) -> None:
    for value, (category, n, tokens) in ROWS.items():
        folder = root / "data" / value.split("-")[0]
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({
            "source": [value] * n, "date": ["2024-01-01"] * n, "text": ["x"] * n,
            "token_count": pa.array([tokens] * n, pa.int64()), "category": [category] * n,
        }), folder / f"{value}-0000.parquet")


def run(*args: str, dolma3: Path | None = None) -> subprocess.CompletedProcess:
    """The tool from the repository root; ``dolma3``: the folder $DOLMA3_DIR names (the real config's globs)."""
    env = {k: v for k, v in os.environ.items() if k != "DOLMA3_DIR"} | ({"DOLMA3_DIR": str(dolma3)} if dolma3 else {})
    return subprocess.run([sys.executable, "scripts/inspect_corpus.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_values_rows_tokens_and_the_mixture_source_each_filter_gives(tmp_path):
    make_dolma3_layout(tmp_path)
    r = run(str(tmp_path), "--config", "configs/pretrain_350m_20b.yaml", dolma3=tmp_path)
    assert r.returncode == 1, r.stderr  # reddit_dump is unclaimed: train fit would refuse the mapping
    out = r.stdout
    total = sum(n * t for _, n, t in ROWS.values())
    assert f"6 files, 17 rows, {total:,} tokens" in out
    table = out.split("corpus mapping")[0]  # the value table (the mapping report follows it)
    lines = {ln.split()[0]: ln.split() for ln in table.splitlines() if ln.startswith("  ") and len(ln.split()) >= 5}
    assert lines["common_crawl-food-0012"][1:3] == ["5", "500"] and lines["common_crawl-food-0012"][-1] == "web"
    assert lines["stack_edu-python"][-1] == "code"
    assert lines["olmocr_science_pdfs-1"][-1] == "pdfs"
    assert lines["finemath-3plus"][-1] == "curated" and lines["wikipedia"][-1] == "curated"
    assert lines["reddit_dump"][-1] == "-"
    assert "unclaimed `source` values (never read):\n    reddit_dump " in out
    assert "curated: 5 rows, 110 tokens" in out  # 4 x 25 + 1 x 10
    assert "MATCHES NOTHING" not in out.split("corpus mapping")[0]
    assert "error: data.unclaimed: `source` value(s) 'reddit_dump' (1 in all," in out
    assert "  'wiki*' (optional):\n    wikipedia " in out  # the start-up mapping report


def test_an_empty_folder_is_an_error_naming_it(tmp_path):
    r = run(str(tmp_path))
    assert r.returncode == 2 and str(tmp_path) in r.stderr


def test_stacked_configs_and_data_overrides_resolve_as_train_fit_resolves_them(tmp_path):
    """The tool reads the configuration the way ``train fit`` does: a preset stacked on the real config,
    and a ``--data.unclaimed`` override that turns the unclaimed-share refusal (0.5% of the tokens here)
    into a warning, placed before and after the folder argument."""
    make_dolma3_layout(tmp_path)
    r = run("--config", "configs/pretrain_350m_20b.yaml", str(tmp_path), "--config", "configs/presets/64gpu.yaml",
            "--data.unclaimed", "0.01", "--sample-rows", "0", dolma3=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning: `source` value(s) 'reddit_dump'" in r.stdout and "(below data.unclaimed 1.000%)" in r.stdout
    r = run(str(tmp_path), "--config", "configs/pretrain_350m_20b.yaml", "--data.unclamed", "0.01")
    assert r.returncode == 2 and "did you mean --data.unclaimed" in r.stderr, r.stderr


def test_a_config_maps_each_sources_own_files_and_is_refused_where_fit_refuses_it(tmp_path, demo_corpus):
    """Guards: the mapping built over every file of DIR, not over each source's globs: on the demo config every
    source read all 16 files (fit reads 7, 5, 2, 2), and a config fit refuses (a glob matching nothing, the
    real config without $DOLMA3_DIR) passed. The files are the ones fit reads (data/source_files.py), and a
    refusal is fit's line."""
    from data.config import resolve_data_config
    from data.errors import ConfigError, error_lines
    from data.source_files import list_files

    own = tmp_path / "own.yaml"
    sources = {s: {"paths": [str(demo_corpus / s / "*.parquet")]} for s in ("web", "code", "books", "curated")}
    own.write_text(yaml.safe_dump({"data": {"sources": sources}}, sort_keys=False))
    r = run(str(demo_corpus), "--config", "configs/demo.yaml", "--config", str(own), "--sample-rows", "0")
    assert r.returncode == 0, r.stderr
    assert [f"{s}: no filter: every row of its {n} file(s)" for s, n in (("web", 7), ("code", 5), ("books", 2),
                                                                        ("curated", 2))] == [
        ln for ln in r.stdout.splitlines() if "no filter" in ln]
    typo = tmp_path / "typo.yaml"
    typo.write_text(own.read_text().replace("/books/", "/bokos/"))
    for argv, dolma3 in ((["--config", "configs/demo.yaml", "--config", str(typo)], None),
                         (["--config", "configs/pretrain_350m_20b.yaml"], None)):
        r = run(str(demo_corpus), *argv, "--sample-rows", "0", dolma3=dolma3)
        with pytest.raises(ConfigError) as fit_refusal:  # what train fit's manifest build refuses, and how
            list_files(resolve_data_config([a if a.startswith("-") else str(ROOT / a) for a in argv]))
        assert r.returncode == 2 and r.stderr.strip() == error_lines(fit_refusal.value), r.stderr
