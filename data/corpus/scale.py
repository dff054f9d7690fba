"""Write a synthetic corpus with the shape of dolma3_300B_sample_shuffled, to measure the data path on.

    python scripts/make_scale_corpus.py --out scale_corpus                     # 4 files x 100k rows
    python scripts/make_scale_corpus.py --out /tmp/sc --files 2 --rows 8000 --row-group 8000

(the command line is scripts/make_scale_corpus.py; the library is this module)

The shape that matters for the data path, not the content: the Dolma3 schema (source, date, text,
token_count, category); every file mixes all sub-sources (so a mixture source is a *filter* on the
``source`` column, and one chunk of it is a whole row group of which a share is its rows); ~100k rows
per file in large row groups (pyarrow's default keeps ~100k rows per group); per sub-source document
lengths drawn around the published means (Common Crawl ~1.4k tokens/doc, olmOCR science PDFs ~9.6k,
Stack-Edu ~0.8k, arXiv ~5.6k, FineMath ~1.6k, Wikipedia ~0.6k: lognormal, sigma 1) with a long tail
(0.2% of PDF and arXiv documents hold 100k-250k tokens). The text is real text reused from the demo
corpus (windows of its concatenated text), so tokenization costs what it costs on real data;
``token_count`` is the window's length in tokens at the demo corpus's characters per token.

The four mixture sources of configs/demo.yaml map onto sub-sources with :func:`scale_sources`.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import files
from data.config import arrow_schema
from data.corpus import PAGE_OPTIONS

SUB_SOURCES = {  # sub-source: (share of documents, mean tokens per document)
    "common-crawl": (0.60, 1_400),
    "olmocr_science_pdfs": (0.05, 9_600),
    "stack_edu": (0.20, 800),
    "arxiv": (0.03, 5_600),
    "finemath-3plus": (0.07, 1_600),
    "wikipedia": (0.05, 600),
}
LONG_TAIL = {"olmocr_science_pdfs": 0.002, "arxiv": 0.002}
"""Share of a sub-source's documents drawn from 100k-250k tokens (books, theses, scanned volumes)."""
MIXTURE = {"web": ["common-crawl"], "code": ["stack_edu"], "books": ["olmocr_science_pdfs"],
           "curated": ["arxiv", "finemath-3plus", "wikipedia"]}
"""The demo config's mixture sources as filters on the ``source`` column."""


def scale_sources(root: str | Path) -> dict:
    """``data.sources`` for the scale corpus: the four mixture sources as filters on ``source``."""
    from data.config import FilterConfig, SourceConfig

    pattern = str(Path(root) / "*.parquet")
    return {name: SourceConfig(paths=[pattern], filter=FilterConfig(column="source", values=subs))
            for name, subs in MIXTURE.items()}


def text_pool(demo: Path) -> tuple[str, float]:
    """The demo corpus's text, concatenated, and its characters per cl100k token."""
    texts, tokens = [], 0
    for path in sorted(demo.glob("*/*.parquet")):
        table = pq.read_table(path, columns=["text", "token_count"])
        texts += table.column("text").to_pylist()
        tokens += sum(table.column("token_count").to_pylist())
    pool = "\n\n".join(texts)
    return pool, len(pool) / max(1, tokens)


def doc_lengths(rng: np.random.Generator, sub: str, n: int) -> np.ndarray:
    """Tokens per document: lognormal around the sub-source's mean, with its long tail."""
    mean, sigma = SUB_SOURCES[sub][1], 1.0
    out = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n).astype(np.int64) + 8
    tail = rng.random(n) < LONG_TAIL.get(sub, 0.0)
    out[tail] = rng.integers(100_000, 250_000, int(tail.sum()))
    return np.minimum(out, 250_000)


def write_file(path: Path, rows: int, row_group: int, pool: str, chars_per_token: float,
               rng: np.random.Generator, small_pages: bool = False) -> int:
    """One file of ``rows`` documents mixing every sub-source in random order; returns its tokens.
    Pages as pyarrow writes them by default (as a corpus from elsewhere has them), or with
    ``small_pages`` as this repo's corpus tools write them (data/corpus/__init__.py PAGE_OPTIONS)."""
    names = list(SUB_SOURCES)
    shares = np.array([SUB_SOURCES[s][0] for s in names])
    which = rng.choice(len(names), size=rows, p=shares / shares.sum())
    lengths = np.empty(rows, dtype=np.int64)
    for i, sub in enumerate(names):
        sel = which == i
        lengths[sel] = doc_lengths(rng, sub, int(sel.sum()))
    texts = []
    for n in lengths:
        width = min(len(pool) - 1, int(n * chars_per_token))
        start = int(rng.integers(0, len(pool) - width))
        texts.append(pool[start:start + width])
    table = pa.table({
        "source": pa.array([names[i] for i in which], pa.string()),
        "date": pa.array(["2024-06-01"] * rows, pa.string()),
        "text": pa.array(texts, pa.string()),
        "token_count": pa.array(lengths, pa.int64()),
        "category": pa.array([names[i].split("_")[0] for i in which], pa.string()),
    }, schema=arrow_schema())
    with files.atomic_path(path, fsync=False) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group, **(PAGE_OPTIONS if small_pages else {}))
    return int(lengths.sum())


def make_scale_corpus(out: Path, files: int = 4, rows: int = 100_000, row_group: int = 100_000, seed: int = 0,
                      demo: Path | None = None, small_pages: bool = False) -> int:
    """Writes ``files`` shards into ``out``; returns the total tokens."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if demo is None:
            from data.corpus.demo import build_demo_corpus

            demo = Path(tmp) / "demo"
            build_demo_corpus(demo)
        pool, cpt = text_pool(demo)
    rng = np.random.default_rng(seed)
    return sum(write_file(out / f"dolma3-shaped-{i:04d}.parquet", rows, row_group, pool, cpt, rng, small_pages)
               for i in range(files))
