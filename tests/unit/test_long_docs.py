"""Book-length documents: bounded commitment keeps long-run and per-phase shares on target.

A synthetic corpus whose books hold 100k-200k tokens (x200-400 the sequence length here, as 200k
tokens are x100 a 2,048-token sequence). With ``data.commit: document`` (the older rule) one such book
holds one of the 4 rows of a consumer for hundreds of steps and the long-run shares drift by whole
books; with ``data.commit: sequence`` (the default) a choice commits at most one sequence and the
rest of the book waits, in order, for its source's next turn.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig, SourceConfig
from data.manifest import build_manifest
from data.schedules import fixed_schedule
from data.simulate import OrderSimulator
from data.tokenizer import TokenizerConfig

count_tokens = TokenizerConfig().build().count

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
WEIGHTS = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}
ANNEAL = {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}


def write(folder: Path, name: str, lengths, seed: int, row_group: int) -> None:
    """Documents of about ``lengths`` tokens each (one token per word here)."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, int(n))) for n in lengths]
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"source": [name] * len(texts), "date": ["2024-01-01"] * len(texts), "text": texts,
                      "token_count": pa.array(count_tokens(texts), pa.int64()), "category": [name] * len(texts)})
    pq.write_table(table, folder / f"{name}.parquet", row_group_size=row_group)


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("long_docs")
    rng = np.random.default_rng(0)
    write(root / "web", "web", rng.lognormal(6, 0.8, 3000).astype(int) + 20, 1, 64)
    write(root / "code", "code", rng.lognormal(5.5, 1.0, 2000).astype(int) + 20, 2, 64)
    books = list(rng.integers(2_000, 30_000, 30)) + [100_000, 150_000, 200_000, 120_000]
    write(root / "books", "books", books, 3, 2)
    write(root / "curated", "curated", rng.lognormal(6.5, 0.7, 800).astype(int) + 20, 4, 32)
    return root


def cfg_for(root: Path, commit: str, seed: int, **kw) -> DataConfig:
    kw.setdefault("schedule", fixed_schedule(WEIGHTS, 512))
    return DataConfig(sources={s: SourceConfig([str(root / s / "*.parquet")]) for s in WEIGHTS}, seed=seed,
                      batch_size=4, buffer_size=64, open_shards=4, num_workers=1, commit=commit,
                      manifest_cache=str(root / "cache"), **kw)


def shares(root: Path, commit: str, seed: int, steps: int) -> tuple[float, float, list[dict]]:
    """(long-run max |share - target|, mean per-batch total-variation distance, the batches' pieces)."""
    cfg = cfg_for(root, commit, seed)
    sim = OrderSimulator(build_manifest(cfg), cfg, 1, 1)
    batches = [b for _, _, b in sim.batches(steps)]
    tokens = np.array([b["source_tokens"] for b in batches], dtype=np.float64)
    w = np.array(list(WEIGHTS.values()))
    long_run = float(np.abs(tokens.sum(0) / tokens.sum() - w).max())
    per_batch = float((0.5 * np.abs(tokens / tokens.sum(1, keepdims=True) - w).sum(1)).mean())
    return long_run, per_batch, batches


def test_bounded_commitment_keeps_long_run_shares_and_flatness(long_corpus):
    """300 steps of 4 x 512 tokens, 2 seeds. Bound: 0.005 on the long-run share error (measured 0.0006,
    against 0.015 with whole-document commitment); per-batch distance no worse than the older rule's."""
    old = [shares(long_corpus, "document", seed, 300) for seed in (1, 2)]
    new = [shares(long_corpus, "sequence", seed, 300) for seed in (1, 2)]
    new_err, old_err = np.mean([x[0] for x in new]), np.mean([x[0] for x in old])
    assert new_err < 0.005, new_err
    assert new_err < old_err / 3, (new_err, old_err)
    assert np.mean([x[1] for x in new]) <= 1.05 * np.mean([x[1] for x in old])
    # the pieces of every document stay in order, one row at a time
    ends: dict[str, int] = defaultdict(int)
    for b in new[0][2]:
        ids = [p[0] for p in b["pieces"]]
        assert len(set(ids)) == len(ids)
        for doc_id, off, n in b["pieces"]:
            assert off == ends[doc_id] or off == 0, (doc_id, off, ends[doc_id])
            ends[doc_id] = off + n


def test_per_phase_shares_with_books(long_corpus):
    """A stable and an anneal phase: each phase's realised shares within 0.01 of its weights."""
    schedule = {
        "train_tokens": 800_000, "global_batch_size": 4,
        "seq_len": {"start": 512, "end": 512, "warmup_steps": 0, "multiple": 64},
        "anneal_start": 0.5,
        "mixture": {"phases": [{"name": "stable", "weights": WEIGHTS},
                               {"name": "anneal", "start": "anneal", "weights": ANNEAL}]},
    }
    cfg = cfg_for(long_corpus, "sequence", 1, schedule=schedule)
    sim = OrderSimulator(build_manifest(cfg), cfg, 1, 1)
    per_step = [(step, b["source_tokens"].copy()) for step, _, b in sim.batches(sim.steps.total_steps)]
    boundary = sim.steps.by_optimizer_step.anneal_step
    for name, in_phase, target in [("stable", lambda s: s < boundary, WEIGHTS),
                                   ("anneal", lambda s: s >= boundary, ANNEAL)]:
        tokens = sum(t for s, t in per_step if in_phase(s))
        np.testing.assert_allclose(tokens / tokens.sum(), list(target.values()), atol=0.01, err_msg=name)
