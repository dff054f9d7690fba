"""scripts/inspect_corpus.py on a corpus in the Dolma3 layout (sub-source folders, suffixed values)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

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


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/inspect_corpus.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_values_rows_tokens_and_the_mixture_source_each_filter_gives(tmp_path):
    make_dolma3_layout(tmp_path)
    r = run(str(tmp_path), "--config", "configs/pretrain_350m_20b.yaml")
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
            "--data.unclaimed", "0.01", "--sample-rows", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning: `source` value(s) 'reddit_dump'" in r.stdout and "(below data.unclaimed 1.000%)" in r.stdout
    r = run(str(tmp_path), "--config", "configs/pretrain_350m_20b.yaml", "--data.unclamed", "0.01")
    assert r.returncode == 2 and "did you mean --data.unclaimed" in r.stderr, r.stderr
