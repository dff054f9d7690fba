"""Shared fixtures: the real demo corpus, built once per test session, and small data configs on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")

from data.config import DataConfig, SourceConfig  # noqa: E402

SOURCES = ["web", "code", "books", "curated"]
WEIGHTS = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> Path:
    from data.demo_corpus import build_demo_corpus

    out = tmp_path_factory.mktemp("demo_corpus")
    build_demo_corpus(out)
    return out


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("manifest_cache")


@pytest.fixture
def make_cfg(demo_corpus, cache_dir):
    """DataConfig on the demo corpus with small, fast defaults; keyword overrides."""

    def make(**overrides) -> DataConfig:
        kw = dict(
            sources={s: SourceConfig(paths=[str(demo_corpus / s / "*.parquet")]) for s in SOURCES},
            weights=dict(WEIGHTS),
            seed=1234,
            batch_size=4,
            seq_len=128,
            buffer_size=64,
            open_shards=4,
            num_workers=2,
            manifest_cache=str(cache_dir),
        )
        kw.update(overrides)
        return DataConfig(**kw)

    return make


@pytest.fixture(autouse=True)
def _restore_environ():
    """Every test leaves os.environ as it found it. Lightning writes MASTER_ADDR / MASTER_PORT /
    NODE_RANK into os.environ when a Trainer is built under an (injected) SLURM environment; leaked
    into later tests, the DDP subprocesses they start try to rendezvous with a fake host and hang."""
    saved = dict(os.environ)
    rank = _rank_zero_only_rank()
    yield
    os.environ.clear()
    os.environ.update(saved)
    if rank is not None:  # a Trainer built under an injected SLURM rank 5 leaves rank_zero_only.rank = 5:
        _set_rank_zero_only_rank(rank)  # a later logger test in this process would then write nothing


def _rank_zero_only_rank() -> int | None:
    if "lightning_utilities.core.rank_zero" not in sys.modules:
        return None
    return getattr(sys.modules["lightning_utilities.core.rank_zero"].rank_zero_only, "rank", None)


def _set_rank_zero_only_rank(rank: int) -> None:
    for name in ("lightning_utilities.core.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.utilities.rank_zero"):
        if name in sys.modules:
            sys.modules[name].rank_zero_only.rank = rank
