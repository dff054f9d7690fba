"""A tiny corpus shaped like the Dolma 3 sample: the real sub-source names, in both spellings, mixed.

For tests and the worked example of docs/data-download.md: rows of every Dolma 3 sub-source name the
public mix definitions use (``common_crawl_<topic>`` and the directory form ``common_crawl-<topic>-NNNN``,
``s2pdf_<topic>`` and ``olmocr_science_pdfs``, ``stack-edu_<Lang>`` and ``stack_edu-<Lang>``,
``finemath-3plus``, and the folder-derived ``rpj-proofpile-arxiv`` / ``dolma1_7-wiki-en``), with token
shares near the published ones, shuffled over a few files (like ``dolma3_300B_sample_shuffled``).
FineMath documents appear twice each, as the mix's upsampling leaves duplicates in the sample.
``token_count`` is the real cl100k count of each text.

    python -m data.corpus.dolma3_like OUT [--extra megamath_web=0.005]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.config import arrow_schema

SUBSOURCES = {  # value -> (share of the tokens, tokens per document, category)
    "common_crawl_science_math_and_technology": (0.400, 300, "web"),
    "common_crawl_health": (0.200, 300, "web"),
    "common_crawl-literature-0001": (0.161, 300, "web"),
    "s2pdf_science_tech": (0.070, 2000, "pdf"),
    "olmocr_science_pdfs": (0.066, 2000, "pdf"),
    "stack-edu_Python": (0.035, 150, "code"),
    "stack_edu-Python": (0.034, 150, "code"),
    "finemath-3plus": (0.0256, 200, "math"),
    "rpj-proofpile-arxiv": (0.0086, 500, "arxiv"),
    "dolma1_7-wiki-en": (0.0004, 24, "wiki"),
}
DUPLICATED = ("finemath-3plus",)  # each document written twice
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "theta", "sigma", "kappa")


def _texts(value: str, n_docs: int, tokens: int) -> list[str]:
    words = max(1, tokens - 8)
    return [f"[{value} {i}] " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(n_docs)]


def write_dolma3_like(out: str | Path, total_tokens: int = 60_000, files: int = 3, seed: int = 0,
                      extra: dict[str, float] | None = None, row_group_size: int = 16) -> list[Path]:
    """Write ``files`` parquet shards (Dolma3 schema) under ``out``; ``extra`` adds sub-sources
    (value -> share of ``total_tokens``, 100-token documents). Returns the paths."""
    from data.tokenizer import TokenizerConfig

    spec = {**SUBSOURCES, **{v: (share, 100, "other") for v, share in (extra or {}).items()}}
    rows = [row for value, (share, tokens, category) in spec.items()
            for row in _rows(value, category, max(1, round(total_tokens * share / tokens)), tokens)]
    order = np.random.default_rng(seed).permutation(len(rows))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, part in enumerate(np.array_split(order, files)):
        picked = [rows[i] for i in part]
        texts = [t for _, _, t in picked]
        table = pa.table({
            "source": pa.array([s for s, _, _ in picked], pa.string()),
            "date": pa.array(["2025-10-01"] * len(picked), pa.string()),
            "text": pa.array(texts, pa.string()),
            "token_count": pa.array(TokenizerConfig().build().count(texts), pa.int64()),
            "category": pa.array([c for _, c, _ in picked], pa.string()),
        }, schema=arrow_schema())
        path = out / f"part-{f:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def _rows(value: str, category: str, n: int, tokens: int) -> list[tuple[str, str, str]]:
    """``n`` rows ``(source, category, text)`` of one sub-source; a DUPLICATED one writes each text twice."""
    if value not in DUPLICATED:
        return [(value, category, t) for t in _texts(value, n, tokens)]
    docs = _texts(value, -(-n // 2), tokens)
    return [(value, category, t) for t in ((docs * 2)[:n] if n > 1 else docs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--extra", action="append", default=[], help="VALUE=SHARE: an added sub-source")
    args = p.parse_args(argv)
    extra = {v: float(s) for v, s in (e.split("=", 1) for e in args.extra)}
    for path in write_dolma3_like(args.out, extra=extra):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
